// trainer/json.cpp — the JSON library's writer and reader, instantiated once
// for the whole trainer (trainer/json.h says why), and the checks a file
// from outside gets before its value is believed.
#include "trainer/json.h"

#include <set>

namespace bert {

std::string json_text(const json& value, int indent) { return value.dump(indent); }

json parse_json(const std::string& text, const json::parser_callback_t& callback) {
  return json::parse(text, callback);
}

bool parse_json_events(const std::string& text, nlohmann::json_sax<json>& events) {
  return json::sax_parse(text, &events);
}

size_t first_nesting_beyond(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return i;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return std::string::npos;
}

json parse_json_keys_once(const std::string& text, const std::function<void(const std::string& key)>& twice) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  json::parser_callback_t no_duplicates = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    else if (event == json::parse_event_t::object_end) keys.pop_back();
    else if (event == json::parse_event_t::key && !keys.back().insert(parsed.get<std::string>()).second)
      twice(parsed.get<std::string>());
    return true;
  };
  return parse_json(text, no_duplicates);  // strict: nothing may follow the value
}

// --- NumberTexts: each number's text by its key path ---------------------------------

NumberTexts::NumberTexts(const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '"') {  // a string, escapes and all: no number inside it counts
      for (++i; i < text.size() && text[i] != '"'; ++i) i += text[i] == '\\';
    } else if (text[i] == '-' || (text[i] >= '0' && text[i] <= '9')) {
      const size_t end = text.find_first_not_of("0123456789+-.eE", i);
      written.push_back(text.substr(i, end == std::string::npos ? std::string::npos : end - i));
      i = end == std::string::npos ? text.size() : end - 1;
    }
  }
}
NumberTexts number_texts(const std::string& text) {
  NumberTexts numbers(text);
  parse_json_events(text, numbers);  // this pass only collects the numbers' texts
  return numbers;
}
bool NumberTexts::integer() {
  if (next < written.size()) texts[here()] = written[next];
  ++next;
  return value();
}

std::string NumberTexts::here() const {
  std::string where;
  for (size_t level = 0; level < keys.size(); ++level)
    where +=
        indices[level] >= 0 ? "[" + std::to_string(indices[level]) + "]" : (where.empty() ? "" : ".") + keys[level];
  return where;
}
bool NumberTexts::value() {
  if (!indices.empty() && indices.back() >= 0) ++indices.back();
  return true;
}
bool NumberTexts::open(long index) {
  keys.emplace_back();
  indices.push_back(index);
  return true;
}
bool NumberTexts::close() {
  keys.pop_back();
  indices.pop_back();
  return value();
}
bool NumberTexts::number_float(number_float_t, const string_t& text) {
  texts[here()] = text;
  ++next;  // (its text, in `written` too, is the library's)
  return value();
}
bool NumberTexts::key(string_t& key) {
  keys.back() = key;
  return true;
}

}  // namespace bert
