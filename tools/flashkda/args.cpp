#include "args.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>

namespace flashkda::cli {

FlagParser::FlagParser(std::string command, std::string usage, std::string summary)
    : command_(std::move(command)), usage_(std::move(usage)), summary_(std::move(summary)) {}

void FlagParser::add(const std::string& name, const std::string& metavar, const std::string& help,
                     std::function<void(const std::string&)> apply) {
  flags_.push_back({name, metavar, help, std::move(apply)});
}

void FlagParser::add_switch(const std::string& name, const std::string& help, std::function<void()> apply) {
  flags_.push_back({name, "", help, [apply = std::move(apply)](const std::string&) { apply(); }});
}

const FlagParser::Flag* FlagParser::find(const std::string& name) const {
  for (const Flag& f : flags_)
    if (f.name == name) return &f;
  return nullptr;
}

bool FlagParser::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << help();
      return false;
    }
    if (arg.rfind("--", 0) != 0)
      throw UsageError(command_ + ": unexpected argument '" + arg + "' (flags start with --; see " + command_ +
                       " --help)");
    std::string name = arg, value;
    bool has_inline_value = false;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_inline_value = true;
    }
    const Flag* flag = find(name);
    if (!flag) throw UsageError(command_ + ": unknown flag '" + name + "' (see " + command_ + " --help)");
    if (flag->metavar.empty()) {
      if (has_inline_value) throw UsageError(command_ + ": flag " + name + " takes no value, got '" + value + "'");
    } else if (!has_inline_value) {
      if (i + 1 >= argc) throw UsageError(command_ + ": flag " + name + " needs a value " + flag->metavar);
      value = argv[++i];
    }
    flag->apply(value);
  }
  return true;
}

std::string FlagParser::help() const {
  std::ostringstream os;
  os << "usage: " << usage_ << "\n\n" << summary_ << "\n\nflags:\n";
  // One entry: the flag and its value name, then the help text (which may hold several lines),
  // every line indented to one column.
  const size_t column = 30;
  auto entry = [&](const std::string& head, const std::string& text) {
    os << head;
    size_t pad = column - head.size();
    if (head.size() + 1 >= column) {
      os << "\n";
      pad = column;
    }
    std::istringstream lines(text);
    std::string line;
    bool first_line = true;
    while (std::getline(lines, line)) {
      os << std::string(first_line ? pad : column, ' ') << line << "\n";
      first_line = false;
    }
  };
  for (const Flag& f : flags_) entry("  " + f.name + (f.metavar.empty() ? "" : " " + f.metavar), f.help);
  entry("  --help", "print this help and exit");
  if (!epilog_.empty()) os << "\n" << epilog_;
  return os.str();
}

int64_t parse_int(const std::string& flag, const std::string& text, int64_t min_value, int64_t max_value) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    throw UsageError(flag + ": expected an integer, got '" + text + "'");
  if (v < min_value || v > max_value)
    throw UsageError(flag + ": expected an integer in [" + std::to_string(min_value) + ", " +
                     std::to_string(max_value) + "], got " + text);
  return v;
}

uint64_t parse_uint64(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 0);
  if (text.empty() || text[0] == '-' || *end != '\0' || errno == ERANGE)
    throw UsageError(flag + ": expected a non-negative integer, got '" + text + "'");
  return v;
}

double parse_double(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') throw UsageError(flag + ": expected a number, got '" + text + "'");
  return v;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t pos = text.find(sep, start);
    parts.push_back(text.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return parts;
}

std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& text, int64_t min_value,
                                    int64_t max_value) {
  std::vector<int64_t> values;
  for (const std::string& part : split(text, ',')) {
    if (part.empty())
      throw UsageError(flag + ": expected a comma-separated list of integers such as 100,200, got '" + text + "'");
    values.push_back(parse_int(flag, part, min_value, max_value));
  }
  return values;
}

int parse_choice(const std::string& flag, const std::string& text, const std::vector<std::string>& choices) {
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == text) return static_cast<int>(i);
    list += (i ? "|" : "") + choices[i];
  }
  throw UsageError(flag + ": expected one of " + list + ", got '" + text + "'");
}

}  // namespace flashkda::cli
