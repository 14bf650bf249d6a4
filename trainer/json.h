// trainer/json.h — the JSON library (nlohmann/json) as the trainer uses it:
// its value type, and its writer and readers as functions compiled once, in
// trainer/json.cpp. The library's serializer and parser are templates that
// every file calling dump(), json::parse or json::sax_parse compiles and
// optimizes again, seconds each; the trainer's files call json_text,
// parse_json and parse_json_events instead, and only build, read and
// compare values themselves. (The model's file, train_bert_mini.cu,
// includes no JSON at all.)
// Layer: settings, of settings → inputs → formats → training (notes/07, "The trainer's layers").
#pragma once

#include <nlohmann/json.hpp>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace bert {

using json = nlohmann::json;

// value.dump(indent): compact with -1, else pretty with that indent.
std::string json_text(const json& value, int indent = -1);
// json::parse(text, callback): the whole text one value, or json::parse_error.
json parse_json(const std::string& text, const json::parser_callback_t& callback = nullptr);
// json::sax_parse(text, &events): the parser's events (each key, value and
// number's text) handed to `events` as they come, no value built.
bool parse_json_events(const std::string& text, nlohmann::json_sax<json>& events);

// --- reading a file someone else wrote ---------------------------------------
//
// The library parses what it is given and keeps the last of two equal keys;
// printing or freeing a value recurses once per level of nesting. A file
// from outside is therefore looked at before it is believed:

// The offset in `text` of the first '{' or '[' that opens a level deeper
// than `max_depth`, or npos: counted on the text, before the library sees
// it (a file nested 100,000 deep would overflow the stack later). Brackets
// inside strings do not count.
size_t first_nesting_beyond(const std::string& text, int max_depth);
// parse_json with each object's keys once each: `twice(key)` is called when
// a key comes again in the same object, and must throw (it names the file).
json parse_json_keys_once(const std::string& text, const std::function<void(const std::string& key)>& twice);

// The text of every number in a JSON text, as written, by its key path
// ("fp16.loss_scale", "optimizer.params.betas[0]"). The library keeps only
// the value, and a message should quote what the user wrote: 1e39, not
// 9.9999999999999994e+38; 64.0, not 64; 18446744073709551616 (beyond
// uint64, so parsed as a double), not 1.8446744073709552e+19; -0, not 0 (an
// integer to JSON and to a long long). Handed to parse_json_events, it
// records each number's text and builds nothing. The SAX interface hands
// over a float's text but not an integer's: given the text, the
// constructor first cuts every number out of it in document order (a
// number starts outside a string with '-' or a digit), and each integer
// event takes its own; without the text only floats are recorded.
struct NumberTexts : nlohmann::json_sax<json> {
  explicit NumberTexts(const std::string& text = "");
  std::vector<std::string> written;  // every number's text, in document order (from the constructor's text)
  size_t next = 0;                   // the next number's index in `written`
  std::map<std::string, std::string> texts;
  std::vector<std::string> keys;  // per open object or array: the current key ("" in an array)
  std::vector<long> indices;      // per open level: the current element's index (-1 in an object)

  std::string here() const;  // the key path of the value being read
  bool value();              // a value ended: the next one in an array has the next index
  bool open(long index);
  bool close();
  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool integer();  // an integer's text, from `written`
  bool number_integer(number_integer_t) override { return integer(); }
  bool number_unsigned(number_unsigned_t) override { return integer(); }
  bool number_float(number_float_t, const string_t& text) override;
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(-1); }
  bool key(string_t& key) override;
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(0); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const json::exception&) override { return false; }
};
// Every number's text of `text` (valid JSON: parsed already), by key path.
NumberTexts number_texts(const std::string& text);

}  // namespace bert
