// The JSON output of the tool: nlohmann/json documents with their fields in the order they are
// set (ordered_json), written to a file that is opened before any work is done, so that a path
// that cannot be written fails at once instead of after a long run.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace flashkda::cli {

using Json = nlohmann::ordered_json;

// Pretty-printed with two-space indentation and a final newline. NaN and Inf become null; bytes
// that are not UTF-8 (in a message or a path) become U+FFFD instead of failing the dump.
std::string dump_json(const Json& doc);

// A JSON output file, opened for writing when constructed and written once by write().
class JsonFile {
 public:
  // Opens `path` for writing (creating it when missing; an existing file keeps its contents until
  // write()). Throws UsageError "<flag>: cannot open '<path>' for writing: <OS reason>" when it
  // cannot.
  JsonFile(std::string path, const std::string& flag);
  // Closes the file; a file this object created and never wrote is removed again.
  ~JsonFile();
  JsonFile(const JsonFile&) = delete;
  JsonFile& operator=(const JsonFile&) = delete;

  // Replaces the file's contents with dump_json(doc); throws std::runtime_error naming the path
  // and the OS reason when that fails.
  void write(const Json& doc);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool created_ = false, written_ = false;
};

}  // namespace flashkda::cli
