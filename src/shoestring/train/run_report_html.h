// The run report: RUN_DIR/report.html, one self-contained page (no network,
// no JavaScript) that shows a run as its files record it: loss (raw and
// smoothed), learning rate, gradient norm, images/s and peak memory by
// category over the steps of metrics.jsonl (every invocation of the run,
// resumed ones included), as inline SVG plots drawn here; the sample grids
// of samples/ over time, inlined as base64 data: URIs (with their prompt
// lists); the resolved config.toml; the machine that wrote the page.
//
// Bounded whatever the run's length: each plotted series keeps at most
// RunReportOptions::max_points points (min / max per bin, so spikes stay
// visible), each prompt set inlines at most max_grids grids (spread over the
// run, the newest always) within max_inline_bytes; the others are linked by
// their relative path (samples/step-NNNNNN.png). All text from files is
// HTML-escaped.
//
// train() rewrites the page (atomically, io/atomic_file.h) after each
// checkpoint / sample grid and when a run resumes; `shoestring report
// RUN_DIR` rewrites it at any time (after a crash, say).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace shoestring {

/// What bounds the size of report.html.
struct RunReportOptions {
  size_t max_points = 2000;  ///< points per plotted series (>= 4)
  size_t max_grids = 12;     ///< sample grids inlined per prompt set (>= 1)
  int64_t max_inline_bytes = int64_t{16} << 20;  ///< PNG bytes inlined in all (before base64's 4/3)
};

/// One sample grid of a run: samples/step-NNNNNN.png and its .txt sidecar.
struct ReportSampleGrid {
  int64_t step = 0;
  std::string png_path;  ///< absolute or relative to the working directory
  std::string href;      ///< the path relative to the run folder ("samples/step-000100.png")
  std::string sidecar;   ///< the .txt's text ("" when it is missing)
  int64_t bytes = 0;     ///< the PNG's size
};

/// Everything the page is drawn from.
struct RunReportInputs {
  std::string run_dir;
  std::vector<nlohmann::json> metrics;  ///< metrics.jsonl records, sorted by "step" (stable)
  int64_t unreadable_lines = 0;         ///< lines of metrics.jsonl that are not JSON objects (a torn last line)
  std::string config_toml;              ///< config.toml's text ("" when missing)
  std::string machine;                  ///< the machine line (report_machine_line)
  std::string written_at;               ///< "2026-12-03 12:00:00 UTC"
  std::vector<ReportSampleGrid> grids;  ///< sorted by step
};

/// `s` with & < > " ' written as character references, so it can stand in
/// HTML text and in quoted attribute values. Bytes that are not valid UTF-8
/// are written as U+FFFD; C0 controls other than tab / newline / carriage
/// return as "\xHH". Never throws.
std::string html_escape(std::string_view s);

/// Standard base64 (RFC 4648 section 4, with "=" padding) of `bytes`.
std::string base64_encode(std::string_view bytes);

/// At most `max_points` of the points (x, y) (x ascending), chosen per bin:
/// the points are split into max_points / 2 bins of consecutive points and
/// each bin keeps its lowest and highest y (one point when they coincide),
/// in x order. So the global minimum and maximum, and every bin's range,
/// survive. Fewer than max_points points are returned as they are.
/// Throws shoestring::Error when max_points < 2.
std::vector<std::pair<double, double>> downsample_min_max(const std::vector<std::pair<double, double>>& points,
                                                          size_t max_points);

/// The exponential moving average of `values` as the progress line smooths
/// the loss: s = v0, then s = (1 - alpha) s + alpha v; non-finite values are
/// skipped (the output repeats s; NaN until the first finite value).
std::vector<double> ema_smooth(const std::vector<double>& values, double alpha = 0.05);

/// "CPU: <model> | features: ... | bf16 units: yes | device cpu | 2 threads |
/// 1 process" (core/cpu_features.h's describe() and the run's placement).
std::string report_machine_line(const std::string& device, int threads, int world_size);

/// Reads run folder `run_dir`: metrics.jsonl (lines that do not parse are
/// counted, not fatal), config.toml, samples/step-NNNNNN.png with their .txt
/// sidecars (sizes only; the PNGs are read when the page is rendered).
/// Throws shoestring::Error when `run_dir` holds no metrics.jsonl or
/// config.toml (not a run folder) or a file cannot be read.
RunReportInputs read_run_report_inputs(const std::string& run_dir, const std::string& machine);

/// The page's HTML (UTF-8): a summary, one <svg class="plot"> per plot (ids
/// plot-loss, plot-lr, plot-grad-norm, plot-images-per-second, plot-memory)
/// with one <polyline class="series" data-series="NAME"> per series, the
/// sample grids, the config and the machine. Each plot's <svg> carries its
/// axes as data attributes (data-x-min / data-x-max: the steps at the plot
/// area's left / right edges; data-y-min / data-y-max at its bottom / top;
/// data-y-scale "linear" or "log" (base 10); data-left / data-top /
/// data-width / data-height: the plot area in SVG units), so a point's value
/// can be read back from its coordinates. Reads the inlined PNG files.
/// Throws shoestring::Error for options out of range or an unreadable PNG.
std::string render_run_report(const RunReportInputs& inputs, const RunReportOptions& options = {});

/// Writes RUN_DIR/report.html atomically from read_run_report_inputs and
/// render_run_report and returns its path. Throws as those do, and
/// shoestring::Error when the file cannot be written.
std::string write_run_report(const std::string& run_dir, const std::string& machine,
                             const RunReportOptions& options = {});

}  // namespace shoestring
