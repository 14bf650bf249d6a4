// trainer/json.h — the JSON library (nlohmann/json) as the trainer uses it:
// its value type, and its writer and readers as functions compiled once, in
// trainer/json.cpp. The library's serializer and parser are templates that
// every file calling dump(), json::parse or json::sax_parse compiles and
// optimizes again, seconds each; the trainer's files call json_text,
// parse_json and parse_json_events instead, and only build, read and
// compare values themselves. (The model's file, train_bert_mini.cu,
// includes no JSON at all.)
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace bert {

using json = nlohmann::json;

// value.dump(indent): compact with -1, else pretty with that indent.
std::string json_text(const json& value, int indent = -1);
// json::parse(text, callback): the whole text one value, or json::parse_error.
json parse_json(const std::string& text, const json::parser_callback_t& callback = nullptr);
// json::sax_parse(text, &events): the parser's events (each key, value and
// number's text) handed to `events` as they come, no value built.
bool parse_json_events(const std::string& text, nlohmann::json_sax<json>& events);

}  // namespace bert
