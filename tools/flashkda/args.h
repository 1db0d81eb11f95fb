// Command-line flag parsing for the flashkda tool, on CLI11: a table of flags per command, from
// which both the parser and the --help text are built, so every flag is documented. CLI11 stays
// inside args.cpp (its headers are large); the commands see only FlagParser.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace flashkda::cli {

// A bad command line: the message says what was wrong; the tool exits with code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class FlagParser {
 public:
  FlagParser(std::string command, std::string usage, std::string summary);
  ~FlagParser();
  FlagParser(const FlagParser&) = delete;
  FlagParser& operator=(const FlagParser&) = delete;

  // A flag taking a value (--name VALUE or --name=VALUE). `apply` runs once per occurrence, in
  // the order the flags are given, and throws UsageError on a bad value.
  void add(const std::string& name, const std::string& metavar, const std::string& help,
           std::function<void(const std::string&)> apply);
  // A switch without value.
  void add_switch(const std::string& name, const std::string& help, std::function<void()> apply);
  // Free text appended to the help (exit codes, examples).
  void set_epilog(std::string epilog) { epilog_ = std::move(epilog); }

  // Parses argv[first..argc). Returns false when --help (or -h) was given (help already printed
  // to stdout). Throws UsageError on an unknown flag, a missing value, or a value rejected by a
  // flag's apply function.
  bool parse(int argc, char** argv, int first);
  std::string help() const;
  const std::string& command() const { return command_; }

 private:
  struct Impl;  // the CLI::App
  std::string command_, usage_, summary_, epilog_;
  std::unique_ptr<Impl> impl_;
};

// Value parsers: throw UsageError naming the flag, the expectation and the value.
int64_t parse_int(const std::string& flag, const std::string& text, int64_t min_value, int64_t max_value);
uint64_t parse_uint64(const std::string& flag, const std::string& text);
double parse_double(const std::string& flag, const std::string& text);  // any double, nan/inf included
std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& text, int64_t min_value,
                                    int64_t max_value);
std::vector<std::string> split(const std::string& text, char sep);
// Returns the index of `text` in `choices`, else throws UsageError listing them.
int parse_choice(const std::string& flag, const std::string& text, const std::vector<std::string>& choices);

}  // namespace flashkda::cli
