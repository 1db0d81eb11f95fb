// A small streaming JSON writer (objects, arrays, strings, numbers), pretty-printed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashkda::cli {

class JsonWriter {
 public:
  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  JsonWriter& key(const std::string& k);  // inside an object, before its value

  JsonWriter& value(const std::string& s);
  JsonWriter& value(const char* s);
  JsonWriter& value(double x);   // NaN and Inf are written as null
  JsonWriter& value(int64_t x);
  JsonWriter& value(int x) { return value(static_cast<int64_t>(x)); }
  JsonWriter& value(bool b);
  JsonWriter& null();
  JsonWriter& value(const std::vector<int64_t>& xs);  // a one-line array

  template <typename T>
  JsonWriter& field(const std::string& k, const T& v) {
    key(k);
    return value(v);
  }

  const std::string& str() const { return out_; }
  // Writes str() to `path`; throws std::runtime_error naming the path when that fails.
  void save(const std::string& path) const;

 private:
  void before_value();
  void newline();

  std::string out_;
  struct Level {
    bool is_object;
    bool empty = true;
  };
  std::vector<Level> stack_;
  bool after_key_ = false;
};

std::string json_escape(const std::string& s);

}  // namespace flashkda::cli
