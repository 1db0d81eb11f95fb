#include "args.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

namespace flashkda::cli {

namespace {

// Splits "--name=value" into its name and value; has_value tells whether '=' was there.
void split_flag(const std::string& arg, std::string& name, std::string& value, bool& has_value) {
  const size_t eq = arg.find('=');
  has_value = eq != std::string::npos;
  name = has_value ? arg.substr(0, eq) : arg;
  value = has_value ? arg.substr(eq + 1) : std::string();
}

bool is_switch(const CLI::Option* opt) { return opt->get_items_expected_max() == 0; }

}  // namespace

struct FlagParser::Impl {
  CLI::App app;
  Impl(const std::string& summary, const std::string& command) : app(summary, command) {}
};

FlagParser::FlagParser(std::string command, std::string usage, std::string summary)
    : command_(std::move(command)), usage_(std::move(usage)), summary_(std::move(summary)),
      impl_(std::make_unique<Impl>(summary_, command_)) {
  CLI::App& app = impl_->app;
  // --help only: a short -h would also match "-heads" (CLI11 splits short flags); parse() maps a
  // lone -h to --help.
  app.set_help_flag("--help", "print this help and exit");
  // Unknown flags and stray arguments are collected, then reported by parse() in the tool's words.
  app.allow_extras();
}

FlagParser::~FlagParser() = default;

void FlagParser::add(const std::string& name, const std::string& metavar, const std::string& help,
                     std::function<void(const std::string&)> apply) {
  impl_->app.add_option_function<std::string>(name, std::move(apply), help)
      ->type_name(metavar)
      ->trigger_on_parse()  // apply each occurrence as it is parsed, in command-line order
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

void FlagParser::add_switch(const std::string& name, const std::string& help, std::function<void()> apply) {
  impl_->app.add_flag_callback(name, std::move(apply), help)->disable_flag_override()->trigger_on_parse();
}

bool FlagParser::parse(int argc, char** argv, int first) {
  CLI::App& app = impl_->app;
  // CLI11 takes the arguments last-first. "--name=" is passed as "--name" "", so that the
  // flag's own check reports the empty value (CLI11 would take the next argument instead).
  std::vector<std::string> args;
  for (int i = argc - 1; i >= first; --i) {
    const std::string arg = argv[i];
    if (arg == "-h") {
      args.emplace_back("--help");
    } else if (arg.size() > 3 && arg.rfind("--", 0) == 0 && arg.back() == '=' && arg.find('=') + 1 == arg.size()) {
      args.emplace_back();
      args.push_back(arg.substr(0, arg.size() - 1));
    } else {
      args.push_back(arg);
    }
  }
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    std::cout << help();
    return false;
  } catch (const CLI::ArgumentMismatch& e) {
    // A value missing after the last flag, or a value given to a switch: say which, as before.
    for (int i = first; i < argc; ++i) {
      std::string name, value;
      bool has_value = false;
      split_flag(argv[i], name, value, has_value);
      const CLI::Option* opt = app.get_option_no_throw(name);
      if (!opt || name.rfind("--", 0) != 0) continue;
      if (is_switch(opt) && has_value)
        throw UsageError(command_ + ": flag " + name + " takes no value, got '" + value + "'");
      if (!is_switch(opt) && i + 1 == argc && (!has_value || value.empty()))
        throw UsageError(command_ + ": flag " + name + " needs a value " + opt->get_type_name());
    }
    throw UsageError(command_ + ": " + e.what() + " (see " + command_ + " --help)");
  } catch (const CLI::ParseError& e) {
    throw UsageError(command_ + ": " + e.what() + " (see " + command_ + " --help)");
  }
  const std::vector<std::string> extras = app.remaining();
  if (!extras.empty()) {
    const std::string& arg = extras.front();
    if (arg.rfind("--", 0) == 0 && arg.size() > 2) {
      std::string name, value;
      bool has_value = false;
      split_flag(arg, name, value, has_value);
      throw UsageError(command_ + ": unknown flag '" + name + "' (see " + command_ + " --help)");
    }
    throw UsageError(command_ + ": unexpected argument '" + arg + "' (flags start with --; see " + command_ +
                     " --help)");
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
  const CLI::App& app = impl_->app;
  const CLI::Option* help_flag = app.get_help_ptr();
  for (const CLI::Option* opt : app.get_options()) {
    if (opt == help_flag) continue;
    const std::string metavar = is_switch(opt) ? "" : " " + opt->get_type_name();
    entry("  " + opt->get_name() + metavar, opt->get_description());
  }
  entry("  --help", help_flag->get_description());
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
