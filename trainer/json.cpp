// trainer/json.cpp — the JSON library's writer and reader, instantiated once
// for the whole trainer (trainer/json.h says why).
#include "trainer/json.h"

namespace bert {

std::string json_text(const json& value, int indent) { return value.dump(indent); }

json parse_json(const std::string& text, const json::parser_callback_t& callback) {
  return json::parse(text, callback);
}

bool parse_json_events(const std::string& text, nlohmann::json_sax<json>& events) {
  return json::sax_parse(text, &events);
}

}  // namespace bert
