#include "shoestring/optim/optimizer_args.h"

#include <algorithm>
#include <cctype>

#include "shoestring/core/error.h"

namespace shoestring {
namespace {

std::string trim(std::string s) {
  auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  return s;
}

std::optional<double> to_double(const std::string& text) {
  std::string s = trim(text);
  if (s.empty()) return std::nullopt;
  try {
    size_t used = 0;
    double d = std::stod(s, &used);
    if (used != s.size()) return std::nullopt;
    return d;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

OptimizerArgs::OptimizerArgs(const std::vector<std::string>& args, std::string optimizer,
                             std::vector<std::string> valid)
    : optimizer_(std::move(optimizer)) {
  for (const auto& a : args) {
    auto eq = a.find('=');
    if (eq == std::string::npos) fail("optimizer_args: \"{}\" must look like key=value", a);
    std::string key = trim(a.substr(0, eq));
    if (std::find(valid.begin(), valid.end(), key) == valid.end()) {
      fail("optimizer_args: unknown argument '{}' for {} (valid: {})", key, optimizer_, fmt::join(valid, ", "));
    }
    if (values_.count(key)) fail("optimizer_args: '{}' is given twice", key);
    values_[key] = trim(a.substr(eq + 1));
  }
}

void OptimizerArgs::bad(const std::string& key, const std::string& expected) const {
  fail("optimizer_args: {}={} for {}: expected {}", key, values_.at(key), optimizer_, expected);
}

double OptimizerArgs::get_double(const std::string& key, double fallback) const {
  if (!has(key)) return fallback;
  auto d = to_double(values_.at(key));
  if (!d) bad(key, "a number");
  return *d;
}

bool OptimizerArgs::get_bool(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  std::string v = values_.at(key);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  bad(key, "True or False");
}

std::pair<double, double> OptimizerArgs::get_pair(const std::string& key, std::pair<double, double> fallback) const {
  if (!has(key)) return fallback;
  std::string v = values_.at(key);
  if (!v.empty() && (v.front() == '(' || v.front() == '[')) v = v.substr(1);
  if (!v.empty() && (v.back() == ')' || v.back() == ']')) v.pop_back();
  auto comma = v.find(',');
  if (comma == std::string::npos) bad(key, "two numbers a,b");
  auto a = to_double(v.substr(0, comma));
  auto b = to_double(v.substr(comma + 1));
  if (!a || !b) bad(key, "two numbers a,b");
  return {*a, *b};
}

std::string OptimizerArgs::get_choice(const std::string& key, const std::string& fallback,
                                      const std::vector<std::string>& allowed) const {
  if (!has(key)) return fallback;
  std::string v = values_.at(key);
  if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front()) v = v.substr(1, v.size() - 2);
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end())
    bad(key, fmt::format("one of {}", fmt::join(allowed, ", ")));
  return v;
}

std::optional<double> OptimizerArgs::get_optional_double(const std::string& key, std::optional<double> fallback) const {
  if (!has(key)) return fallback;
  std::string v = values_.at(key);
  if (v == "None" || v == "none" || v == "null") return std::nullopt;
  auto d = to_double(v);
  if (!d) bad(key, "a number or None");
  return d;
}

}  // namespace shoestring
