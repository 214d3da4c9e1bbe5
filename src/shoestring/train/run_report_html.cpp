#include "shoestring/train/run_report_html.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/units.h"
#include "shoestring/core/utf8.h"
#include "shoestring/io/atomic_file.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kMiB = 1024.0 * 1024.0;

// Plot geometry, in SVG units (the page shows them 1:1).
constexpr double kPlotWidth = 960, kPlotHeight = 270;
constexpr double kLeft = 72, kRight = 16, kTop = 30, kBottom = 40;

// One colour per series, in order (colour-blind-safe palette, Okabe & Ito).
constexpr const char* kColours[] = {"#0072b2", "#d55e00", "#009e73", "#cc79a7",
                                    "#e69f00", "#56b4e9", "#000000", "#f0e442"};

/// A record's number at `key`; NaN when absent or not a number (metrics.jsonl
/// writes a non-finite double as null).
double number(const nlohmann::json& record, const char* key) {
  auto it = record.find(key);
  if (it == record.end() || !it->is_number()) return kNaN;
  return it->get<double>();
}

int64_t step_of(const nlohmann::json& record) {
  const double s = number(record, "step");
  return std::isfinite(s) ? static_cast<int64_t>(s) : 0;
}

/// One line of a plot.
struct Series {
  std::string name;   ///< data-series and legend
  std::string label;  ///< legend text
  std::vector<std::pair<double, double>> points;  ///< (step, value), finite, step ascending
  double width = 1.5;
  double opacity = 1.0;
};

struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<double> ticks;
};

/// A "nice" tick spacing (1, 2 or 5 x 10^k) near range / target.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / magnitude;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * magnitude;
}

/// A linear axis over [lo, hi] widened to whole tick steps.
Axis linear_axis(double lo, double hi, int target) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double step = nice_step(hi - lo, target);
  Axis a;
  a.lo = std::floor(lo / step) * step;
  a.hi = std::ceil(hi / step) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-9; t += step) a.ticks.push_back(std::abs(t) < step * 1e-9 ? 0 : t);
  return a;
}

/// A base-10 log axis over [lo, hi] (both > 0) widened to whole decades;
/// ticks at the decades, and at 2 and 5 between them for three decades or fewer.
Axis log_axis(double lo, double hi) {
  Axis a;
  a.log = true;
  const int d0 = static_cast<int>(std::floor(std::log10(lo)));
  int d1 = static_cast<int>(std::ceil(std::log10(hi)));
  if (d1 == d0) ++d1;
  a.lo = std::pow(10.0, d0);
  a.hi = std::pow(10.0, d1);
  for (int d = d0; d <= d1; ++d) {
    const double decade = std::pow(10.0, d);
    a.ticks.push_back(decade);
    if (d1 - d0 <= 3 && d < d1) {
      a.ticks.push_back(2 * decade);
      a.ticks.push_back(5 * decade);
    }
  }
  std::sort(a.ticks.begin(), a.ticks.end());
  return a;
}

double fraction(const Axis& a, double v) {
  if (a.log) return (std::log10(v) - std::log10(a.lo)) / (std::log10(a.hi) - std::log10(a.lo));
  return (v - a.lo) / (a.hi - a.lo);
}

std::string tick_label(double v) { return fmt::format("{:.6g}", v); }

/// One plot: an <svg> with axes, grid, one polyline per series and a legend.
/// `log_if_wide`: a base-10 y axis when every value is > 0 and they span more
/// than a factor 20.
std::string render_plot(const std::string& id, const std::string& title, const std::string& y_unit,
                        std::vector<Series> series, bool log_if_wide, size_t max_points, const std::string& note) {
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo, y_lo = x_lo, y_hi = -x_lo;
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      x_lo = std::min(x_lo, x);
      x_hi = std::max(x_hi, x);
      y_lo = std::min(y_lo, y);
      y_hi = std::max(y_hi, y);
    }
  }
  std::string out = fmt::format("<figure>\n<figcaption>{}</figcaption>\n", html_escape(title));
  if (!std::isfinite(x_lo)) {
    return out + fmt::format("<p class=\"empty\" id=\"{}\">no values yet{}</p>\n</figure>\n", id,
                             note.empty() ? "" : " (" + html_escape(note) + ")");
  }
  const Axis x = linear_axis(x_lo, x_hi, 8);
  const Axis y = log_if_wide && y_lo > 0 && y_hi / y_lo > 20 ? log_axis(y_lo, y_hi) : linear_axis(y_lo, y_hi, 5);
  const double w = kPlotWidth - kLeft - kRight, h = kPlotHeight - kTop - kBottom;
  auto px = [&](double v) { return kLeft + w * fraction(x, v); };
  auto py = [&](double v) { return kTop + h * (1 - fraction(y, v)); };

  out += fmt::format(
      "<svg class=\"plot\" id=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "viewBox=\"0 0 {} {}\" data-x-min=\"{:.17g}\" data-x-max=\"{:.17g}\" data-y-min=\"{:.17g}\" "
      "data-y-max=\"{:.17g}\" data-y-scale=\"{}\" data-left=\"{}\" data-top=\"{}\" data-width=\"{}\" "
      "data-height=\"{}\">\n",
      id, kPlotWidth, kPlotHeight, kPlotWidth, kPlotHeight, x.lo, x.hi, y.lo, y.hi, y.log ? "log" : "linear", kLeft,
      kTop, w, h);
  out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#ffffff\" stroke=\"#999999\"/>\n",
                     kLeft, kTop, w, h);
  for (double t : y.ticks) {
    const double yy = py(t);
    out += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" stroke=\"#e5e5e5\"/>"
        "<text x=\"{:.2f}\" y=\"{:.2f}\" text-anchor=\"end\" class=\"tick\">{}</text>\n",
        kLeft, yy, kLeft + w, yy, kLeft - 6, yy + 4, tick_label(t));
  }
  for (double t : x.ticks) {
    const double xx = px(t);
    out += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"{:.2f}\" x2=\"{:.2f}\" y2=\"{:.2f}\" stroke=\"#e5e5e5\"/>"
        "<text x=\"{:.2f}\" y=\"{:.2f}\" text-anchor=\"middle\" class=\"tick\">{}</text>\n",
        xx, kTop, xx, kTop + h, xx, kTop + h + 16, tick_label(t));
  }
  out += fmt::format("<text x=\"{:.2f}\" y=\"{:.2f}\" text-anchor=\"middle\" class=\"axis\">step</text>\n",
                     kLeft + w / 2, kPlotHeight - 4);
  out += fmt::format("<text x=\"12\" y=\"{:.2f}\" class=\"axis\" transform=\"rotate(-90 12 {:.2f})\" "
                     "text-anchor=\"middle\">{}</text>\n",
                     kTop + h / 2, kTop + h / 2, html_escape(y_unit));
  double legend_x = kLeft + 4;
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    const char* colour = kColours[i % (sizeof(kColours) / sizeof(kColours[0]))];
    const auto kept = downsample_min_max(s.points, max_points);
    std::string points;
    points.reserve(kept.size() * 16);
    for (const auto& [vx, vy] : kept) {
      if (!points.empty()) points += ' ';
      points += fmt::format("{:.2f},{:.2f}", px(vx), py(vy));
    }
    out += fmt::format(
        "<polyline class=\"series\" data-series=\"{}\" data-points-total=\"{}\" fill=\"none\" stroke=\"{}\" "
        "stroke-width=\"{}\" stroke-opacity=\"{}\" stroke-linejoin=\"round\" points=\"{}\"/>\n",
        html_escape(s.name), s.points.size(), colour, s.width, s.opacity, points);
    if (kept.size() == 1) {  // a polyline of one point draws nothing
      out += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"3\" fill=\"{}\"/>\n", px(kept[0].first),
                         py(kept[0].second), colour);
    }
    out += fmt::format(
        "<line x1=\"{:.2f}\" y1=\"14\" x2=\"{:.2f}\" y2=\"14\" stroke=\"{}\" stroke-width=\"3\"/>"
        "<text x=\"{:.2f}\" y=\"18\" class=\"legend\">{}</text>\n",
        legend_x, legend_x + 18, colour, legend_x + 22, html_escape(s.label));
    legend_x += 22 + 7.0 * static_cast<double>(s.label.size()) + 18;
  }
  out += "</svg>\n";
  if (!note.empty()) out += fmt::format("<p class=\"note\">{}</p>\n", html_escape(note));
  return out + "</figure>\n";
}

/// (step, value) of every record with a finite value at `key`.
std::vector<std::pair<double, double>> column(const std::vector<nlohmann::json>& metrics, const char* key,
                                              double scale = 1.0) {
  std::vector<std::pair<double, double>> out;
  for (const auto& r : metrics) {
    const double step = number(r, "step"), v = number(r, key);
    if (std::isfinite(step) && std::isfinite(v)) out.emplace_back(step, v * scale);
  }
  return out;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

/// The step of "step-NNNNNN.png" (digits only), or -1.
int64_t grid_step(const std::string& name) {
  const std::string prefix = "step-", suffix = ".png";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 15 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}

std::string render_summary(const RunReportInputs& in) {
  const auto& m = in.metrics;
  std::string out = "<table class=\"summary\">\n";
  auto row = [&out](const std::string& k, const std::string& v) {
    out += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", html_escape(k), html_escape(v));
  };
  row("run folder", in.run_dir);
  if (m.empty()) {
    row("steps", "none recorded yet");
  } else {
    double seconds = 0, images = 0, peak = 0, skipped = 0;
    for (const auto& r : m) {
      const double s = number(r, "seconds"), ips = number(r, "images_per_second");
      if (std::isfinite(s)) seconds += s;
      if (std::isfinite(s) && std::isfinite(ips)) images += s * ips;
      peak = std::max(peak, std::isfinite(number(r, "peak_bytes")) ? number(r, "peak_bytes") : 0.0);
      skipped += r.value("skipped", false) ? 1 : 0;
    }
    std::vector<double> losses;
    for (const auto& r : m) losses.push_back(number(r, "loss"));
    const double smoothed = ema_smooth(losses).back();
    row("steps", fmt::format("{} to {} ({} records)", step_of(m.front()), step_of(m.back()), m.size()));
    row("loss", fmt::format("{:.4g} (last, raw), {:.4g} (EMA 0.95)", losses.back(), smoothed));
    row("step time", fmt::format("{:.1f} min in the recorded steps ({:.3f} s/step, {:.1f} images/s; sampling and "
                                 "saving not included)",
                                     seconds / 60, seconds / static_cast<double>(m.size()),
                                     seconds > 0 ? images / seconds : 0.0));
    row("peak memory", format_bytes(static_cast<int64_t>(peak)));
    if (skipped > 0) row("skipped steps", fmt::format("{} (non-finite gradients: update not applied)", skipped));
  }
  if (in.unreadable_lines > 0) {
    row("metrics.jsonl", fmt::format("{} unreadable line(s) left out (a torn write?)", in.unreadable_lines));
  }
  row("written", in.written_at);
  return out + "</table>\n";
}

/// Which grids of one prompt set are inlined: up to `max_grids` spread over
/// the run (first and newest included), newest first while the byte budget
/// lasts. Returns a flag per grid.
std::vector<bool> choose_inlined(const std::vector<const ReportSampleGrid*>& grids, size_t max_grids,
                                 int64_t& budget) {
  const size_t n = grids.size();
  std::vector<size_t> picks;
  if (n <= max_grids) {
    for (size_t i = 0; i < n; ++i) picks.push_back(i);
  } else if (max_grids == 1) {
    picks.push_back(n - 1);
  } else {
    for (size_t k = 0; k < max_grids; ++k) {
      const size_t i = static_cast<size_t>(std::llround(static_cast<double>(k) * static_cast<double>(n - 1) /
                                                        static_cast<double>(max_grids - 1)));
      if (picks.empty() || picks.back() != i) picks.push_back(i);
    }
  }
  std::vector<bool> inlined(n, false);
  for (auto it = picks.rbegin(); it != picks.rend(); ++it) {  // newest first
    if (grids[*it]->bytes <= budget) {
      inlined[*it] = true;
      budget -= grids[*it]->bytes;
    }
  }
  return inlined;
}

std::string render_grids(const RunReportInputs& in, const RunReportOptions& o) {
  if (in.grids.empty()) return "<p class=\"empty\">no sample grids yet</p>\n";
  // Prompt sets in order of first appearance (a resume may change the prompts).
  std::vector<std::string> order;
  std::map<std::string, std::vector<const ReportSampleGrid*>> sets;
  for (const auto& g : in.grids) {
    if (!sets.count(g.sidecar)) order.push_back(g.sidecar);
    sets[g.sidecar].push_back(&g);
  }
  int64_t budget = o.max_inline_bytes;
  std::string out;
  for (auto set = order.rbegin(); set != order.rend(); ++set) {  // the newest set gets the budget first
    const auto& grids = sets[*set];
    const std::vector<bool> inlined = choose_inlined(grids, o.max_grids, budget);
    std::string section = "<section class=\"prompt-set\">\n";
    if (set->empty()) {
      section += "<p>(no prompt list: the grids' .txt files are missing)</p>\n";
    } else {
      // The sidecar: "# rows: prompts; columns: seeds ...", then a prompt per line.
      std::string header, prompts;
      size_t start = 0;
      while (start < set->size()) {
        size_t end = set->find('\n', start);
        if (end == std::string::npos) end = set->size();
        const std::string line = set->substr(start, end - start);
        if (line.rfind("# ", 0) == 0 && header.empty()) {
          header = line.substr(2);
        } else if (!line.empty()) {
          prompts += "<li>" + html_escape(line) + "</li>";
        }
        start = end + 1;
      }
      if (!header.empty()) section += "<p>" + html_escape(header) + "</p>\n";
      section += "<ol class=\"prompts\">" + prompts + "</ol>\n";
    }
    std::vector<std::string> linked;
    section += "<div class=\"grids\">\n";
    for (size_t i = 0; i < grids.size(); ++i) {
      const ReportSampleGrid& g = *grids[i];
      if (!inlined[i]) {
        linked.push_back(fmt::format("<a href=\"{}\">{}</a>", html_escape(g.href), g.step));
        continue;
      }
      section += fmt::format(
          "<figure class=\"grid\"><img class=\"sample-grid\" alt=\"sample grid at step {}\" "
          "src=\"data:image/png;base64,{}\"><figcaption>step {}</figcaption></figure>\n",
          g.step, base64_encode(read_file(g.png_path)), g.step);
    }
    section += "</div>\n";
    if (!linked.empty()) {
      section += fmt::format(
          "<p class=\"note\">Not inlined (to keep this page small; the links open the files beside it), steps: "
          "{}</p>\n",
          fmt::join(linked, ", "));
    }
    out = section + "</section>\n" + out;  // back in order of appearance
  }
  return out;
}

constexpr const char* kStyle = R"(body { font: 14px/1.4 sans-serif; margin: 16px 24px; color: #222; max-width: 1000px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
figure { margin: 12px 0; } figcaption { font-weight: bold; }
table.summary th { text-align: left; padding-right: 16px; font-weight: normal; color: #555; }
svg.plot text { font: 11px sans-serif; fill: #333; } svg.plot text.axis { font-size: 12px; }
.note, .empty { color: #666; font-size: 12px; }
div.grids { display: flex; flex-wrap: wrap; gap: 12px; }
figure.grid { margin: 0; } figure.grid figcaption { font-weight: normal; text-align: center; }
img.sample-grid { image-rendering: pixelated; border: 1px solid #ccc; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
)";

}  // namespace

std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + s.size() / 8);
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t len = utf8_sequence_length(s, i);
      if (len == 0) {
        out += "\xef\xbf\xbd";  // U+FFFD
        ++i;
      } else {
        out.append(s.substr(i, len));
        i += len;
      }
      continue;
    }
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      case '\t':
      case '\n':
      case '\r': out += static_cast<char>(c); break;
      default:
        if (c < 0x20 || c == 0x7f) {
          out += fmt::format("\\x{:02x}", c);
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  return out;
}

std::string base64_encode(std::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<unsigned char>(bytes[i])} << 16) |
                       (uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8) |
                       uint32_t{static_cast<unsigned char>(bytes[i + 2])};
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  const size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t v = uint32_t{static_cast<unsigned char>(bytes[i])} << 16;
    if (rest == 2) v |= uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::vector<std::pair<double, double>> downsample_min_max(const std::vector<std::pair<double, double>>& points,
                                                          size_t max_points) {
  if (max_points < 2) fail("downsample_min_max: max_points must be >= 2, got {}", max_points);
  if (points.size() <= max_points) return points;
  const size_t n = points.size(), bins = max_points / 2;
  std::vector<std::pair<double, double>> out;
  out.reserve(max_points);
  for (size_t b = 0; b < bins; ++b) {
    const size_t begin = b * n / bins, end = (b + 1) * n / bins;
    size_t lo = begin, hi = begin;
    for (size_t i = begin; i < end; ++i) {
      if (points[i].second < points[lo].second) lo = i;
      if (points[i].second > points[hi].second) hi = i;
    }
    out.push_back(points[std::min(lo, hi)]);
    if (lo != hi) out.push_back(points[std::max(lo, hi)]);
  }
  return out;
}

std::vector<double> ema_smooth(const std::vector<double>& values, double alpha) {
  std::vector<double> out;
  out.reserve(values.size());
  double s = kNaN;
  for (double v : values) {
    if (std::isfinite(v)) s = std::isnan(s) ? v : (1 - alpha) * s + alpha * v;
    out.push_back(s);
  }
  return out;
}

std::string report_machine_line(const std::string& device, int threads, int world_size) {
  return fmt::format("{} | device {} | {} thread{} | {} process{}", describe(cpu_features()), device, threads,
                     threads == 1 ? "" : "s", world_size, world_size == 1 ? "" : "es");
}

RunReportInputs read_run_report_inputs(const std::string& run_dir, const std::string& machine) {
  const fs::path root(run_dir);
  const fs::path metrics = root / "metrics.jsonl";
  if (!fs::is_regular_file(metrics)) {
    fail("'{}' is not a run folder: it holds no metrics.jsonl (a run writes it at its first step)", run_dir);
  }
  RunReportInputs in;
  in.run_dir = run_dir;
  in.machine = machine;
  in.written_at = utc_now();
  const std::string text = read_file(metrics.string());
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + start, end - start);
    start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !std::isfinite(number(j, "step"))) {
      ++in.unreadable_lines;
      continue;
    }
    in.metrics.push_back(std::move(j));
  }
  std::stable_sort(in.metrics.begin(), in.metrics.end(),
                   [](const nlohmann::json& a, const nlohmann::json& b) { return number(a, "step") < number(b, "step"); });
  if (fs::is_regular_file(root / "config.toml")) in.config_toml = read_file((root / "config.toml").string());
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root / "samples", ec)) {
    const std::string name = e.path().filename().string();
    const int64_t step = grid_step(name);
    if (step < 0 || e.is_symlink() || !e.is_regular_file()) continue;
    ReportSampleGrid g;
    g.step = step;
    g.png_path = e.path().string();
    g.href = "samples/" + name;
    g.bytes = static_cast<int64_t>(fs::file_size(e.path()));
    fs::path sidecar = e.path();
    sidecar.replace_extension(".txt");
    if (fs::is_regular_file(sidecar)) g.sidecar = read_file(sidecar.string());
    in.grids.push_back(std::move(g));
  }
  std::sort(in.grids.begin(), in.grids.end(),
            [](const ReportSampleGrid& a, const ReportSampleGrid& b) { return a.step < b.step; });
  return in;
}

std::string render_run_report(const RunReportInputs& in, const RunReportOptions& o) {
  if (o.max_points < 4) fail("run report: max_points must be >= 4, got {}", o.max_points);
  if (o.max_grids < 1) fail("run report: max_grids must be >= 1, got {}", o.max_grids);
  if (o.max_inline_bytes < 0) fail("run report: max_inline_bytes must be >= 0, got {}", o.max_inline_bytes);
  const auto& m = in.metrics;
  const std::string name = fs::path(in.run_dir).filename().string();
  std::string out = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>shoestring run report: "
      "{}</title>\n<style>\n{}</style>\n</head>\n<body>\n<h1>Run report: {}</h1>\n",
      html_escape(name), kStyle, html_escape(name));
  out += render_summary(in);

  out += "<h2>Training</h2>\n";
  std::vector<double> losses;
  int64_t nonfinite = 0;
  for (const auto& r : m) {
    losses.push_back(number(r, "loss"));
    nonfinite += std::isfinite(losses.back()) ? 0 : 1;
  }
  const std::vector<double> smoothed = ema_smooth(losses);
  Series raw{"loss", "loss", column(m, "loss"), 1.0, 0.45};
  Series ema{"loss_ema", "loss, EMA 0.95 (as the progress line)", {}, 2.0, 1.0};
  for (size_t i = 0; i < m.size(); ++i) {
    if (std::isfinite(smoothed[i]) && std::isfinite(number(m[i], "step"))) {
      ema.points.emplace_back(number(m[i], "step"), smoothed[i]);
    }
  }
  const std::string loss_note =
      nonfinite > 0 ? fmt::format("{} non-finite loss(es) not drawn", nonfinite) : std::string();
  out += render_plot("plot-loss", "Loss", "loss", {raw, ema}, true, o.max_points, loss_note);
  out += render_plot("plot-lr", "Learning rate", "learning rate", {{"lr", "learning rate", column(m, "lr")}}, false,
                     o.max_points, "");
  out += render_plot("plot-grad-norm", "Gradient norm (global, before clipping)", "norm",
                     {{"grad_norm", "gradient norm", column(m, "grad_norm")}}, true, o.max_points, "");
  out += render_plot("plot-images-per-second", "Throughput", "images/s",
                     {{"images_per_second", "images/s", column(m, "images_per_second")}}, false, o.max_points, "");

  // Memory: the step's peak per ledger category, and the total's peak.
  std::vector<Series> memory;
  std::vector<std::string> zero;
  for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
    const std::string c = to_string(static_cast<MemoryCategory>(cat));
    const std::string key = "peak_" + c + "_bytes";
    Series s{c, c, column(m, key.c_str(), 1.0 / kMiB)};
    const bool any = std::any_of(s.points.begin(), s.points.end(), [](const auto& p) { return p.second != 0; });
    if (any) {
      memory.push_back(std::move(s));
    } else if (!s.points.empty()) {
      zero.push_back(c);
    }
  }
  memory.push_back({"total", "total", column(m, "peak_bytes", 1.0 / kMiB), 2.0});
  const auto device_total = column(m, "peak_device_bytes", 1.0 / kMiB);
  if (device_total != memory.back().points) memory.push_back({"device_total", "device total", device_total, 2.0});
  const std::string memory_note =
      "each step's peak per memory ledger category (docs/memory.md); the total's peak is not the sum of the "
      "categories' peaks" +
      (zero.empty() ? std::string() : fmt::format("; always 0: {}", fmt::join(zero, ", ")));
  out += render_plot("plot-memory", "Peak memory by category", "MiB", memory, false, o.max_points, memory_note);

  out += "<h2>Sample grids</h2>\n" + render_grids(in, o);
  out += "<h2>Config (config.toml, resolved)</h2>\n";
  out += in.config_toml.empty() ? std::string("<p class=\"empty\">no config.toml</p>\n")
                                : "<pre class=\"config\">" + html_escape(in.config_toml) + "</pre>\n";
  out += "<h2>Machine</h2>\n<p class=\"machine\">" + html_escape(in.machine) +
         "</p>\n<p class=\"note\">the machine that wrote this page (a resumed run may have trained elsewhere "
         "before)</p>\n";
  out += "</body>\n</html>\n";
  return out;
}

std::string write_run_report(const std::string& run_dir, const std::string& machine, const RunReportOptions& o) {
  const std::string html = render_run_report(read_run_report_inputs(run_dir, machine), o);
  const std::string path = (fs::path(run_dir) / "report.html").string();
  write_bytes_atomic(path, html);
  return path;
}

}  // namespace shoestring
