// trainer/json.h — the JSON library (nlohmann/json) as the trainer uses it:
// its value type, and its writer and reader as two functions compiled once,
// in trainer/json.cpp. The library's serializer and parser are templates
// that every file calling dump() or json::parse compiles and optimizes
// again, seconds each; the trainer's files call json_text and parse_json
// instead, and only build, read and compare values themselves. (The model's
// file, train_bert_mini.cu, includes no JSON at all.)
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace bert {

using json = nlohmann::json;

// value.dump(indent): compact with -1, else pretty with that indent.
std::string json_text(const json& value, int indent = -1);
// json::parse(text, callback): the whole text one value, or json::parse_error.
json parse_json(const std::string& text, const json::parser_callback_t& callback = nullptr);

}  // namespace bert
