// The run report (train/run_report_html.h): its helpers against their
// definitions (RFC 4648's base64 vectors, HTML escaping, min / max
// downsampling, the progress line's EMA), the page's plots read back from
// their SVG coordinates against the metrics they were drawn from, escaping
// of hostile config / prompt text, the bounds on long runs, the page a run
// writes (and rewrites when resumed), and the page as headless Chromium
// renders it (skipped where `chromium` is not installed).
#include <stb_image.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/image.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/tensorboard_events.h"
#include "shoestring/train/run_report_html.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;

namespace {

std::string temp_dir(const std::string& name) { return shoestring::testing::fresh_temp_dir("report", name); }

/// A plot of the page: its <svg>'s data attributes and each series' points
/// mapped back from SVG coordinates to (step, value).
struct Plot {
  std::map<std::string, std::string> attrs;
  std::map<std::string, std::vector<std::pair<double, double>>> series;  ///< values
  std::map<std::string, size_t> total;                                    ///< data-points-total
};

Plot plot_of(const std::string& html, const std::string& id) {
  Plot p;
  const size_t begin = html.find("<svg class=\"plot\" id=\"" + id + "\"");
  if (begin == std::string::npos) return p;
  const size_t end = html.find("</svg>", begin);
  const std::string svg = html.substr(begin, end - begin);
  const std::string head = svg.substr(0, svg.find('>'));
  static const std::regex attr(R"re(([a-z-]+)="([^"]*)")re");
  for (std::sregex_iterator it(head.begin(), head.end(), attr), e; it != e; ++it) p.attrs[(*it)[1]] = (*it)[2];
  auto num = [&](const char* k) { return std::stod(p.attrs.at(k)); };
  const double x0 = num("data-x-min"), x1 = num("data-x-max"), y0 = num("data-y-min"), y1 = num("data-y-max");
  const double left = num("data-left"), top = num("data-top"), w = num("data-width"), h = num("data-height");
  const bool log = p.attrs.at("data-y-scale") == "log";
  static const std::regex line(
      R"re(<polyline class="series" data-series="([^"]+)" data-points-total="([0-9]+)"[^>]*points="([^"]*)")re");
  for (std::sregex_iterator it(svg.begin(), svg.end(), line), e; it != e; ++it) {
    auto& pts = p.series[(*it)[1]];
    p.total[(*it)[1]] = std::stoul((*it)[2]);
    std::istringstream in((*it)[3].str());
    std::string pair;
    while (in >> pair) {
      const double px = std::stod(pair.substr(0, pair.find(','))), py = std::stod(pair.substr(pair.find(',') + 1));
      const double t = 1 - (py - top) / h;
      const double y = log ? std::pow(10.0, std::log10(y0) + t * (std::log10(y1) - std::log10(y0))) : y0 + t * (y1 - y0);
      pts.emplace_back(x0 + (px - left) / w * (x1 - x0), y);
    }
  }
  return p;
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The synthetic run's metrics, by formula.
double loss_at(int s) { return 0.9 * std::exp(-s / 10.0) + 0.01; }
double lr_at(int s) { return 1e-3 * s / 50.0; }
double norm_at(int s) { return 1.0 + s % 5; }
double ips_at(int s) { return 100.0 + s; }
constexpr int64_t kMiB = 1 << 20;
int64_t activations_at(int s) { return s * kMiB / 10; }
int64_t total_at(int s) { return 10 * kMiB + s * 1024; }

const char* const kHostile = "</script><b>bold</b>\"'&";

/// A run folder as train() leaves it: `steps` metrics records (step 7's loss
/// non-finite), a config.toml and `grids` sample grids (real PNGs, the
/// hostile prompt in their .txt), a torn last metrics line.
std::string fake_run(const std::string& name, int steps, int grids, int grid_every = 10) {
  const fs::path dir = temp_dir(name);
  fs::create_directories(dir / "samples");
  std::ofstream metrics(dir / "metrics.jsonl");
  for (int s = 1; s <= steps; ++s) {
    nlohmann::json r = {{"step", s},
                        {"loss", s == 7 ? std::nan("") : loss_at(s)},
                        {"lr", lr_at(s)},
                        {"grad_norm", norm_at(s)},
                        {"seconds", 0.1},
                        {"images_per_second", ips_at(s)},
                        {"peak_bytes", total_at(s)},
                        {"peak_device_bytes", total_at(s)},
                        {"skipped", s == 7},
                        {"peak_weights_bytes", 4 * kMiB},
                        {"peak_gradients_bytes", 4 * kMiB},
                        {"peak_optimizer_state_bytes", 0},
                        {"peak_activations_bytes", activations_at(s)},
                        {"peak_temporaries_bytes", 0},
                        {"peak_other_bytes", 0},
                        {"peak_host_offload_bytes", 0}};
    metrics << r.dump() << "\n";
  }
  metrics << "{\"step\": " << steps + 1 << ", \"lo";  // torn by a crash
  metrics.close();
  std::ofstream(dir / "config.toml") << "learning_rate = 0.001\n# " << kHostile << "\n";
  for (int g = 1; g <= grids; ++g) {
    const std::string stem = fmt::format("step-{:06d}", g * grid_every);
    at::Tensor img = torch::full({3, 8, 8}, g * 20 % 256, torch::kUInt8);
    save_png((dir / "samples" / (stem + ".png")).string(), img);
    std::ofstream(dir / "samples" / (stem + ".txt"))
        << "# rows: prompts; columns: seeds 0; 2 sampler steps; cfg 3\nred heart\n" << kHostile << "\n";
  }
  return dir.string();
}

void expect_near_series(const std::vector<std::pair<double, double>>& got, const std::vector<std::pair<double, double>>& want,
                        double tolerance, bool relative) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].first, want[i].first, 1e-3) << i;
    EXPECT_NEAR(got[i].second, want[i].second, relative ? tolerance * std::abs(want[i].second) : tolerance)
        << "point " << i << " (step " << want[i].first << ")";
  }
}

}  // namespace

TEST(RunReportText, Base64MatchesRfc4648Vectors) {
  EXPECT_EQ(base64_encode(""), "");
  EXPECT_EQ(base64_encode("f"), "Zg==");
  EXPECT_EQ(base64_encode("fo"), "Zm8=");
  EXPECT_EQ(base64_encode("foo"), "Zm9v");
  EXPECT_EQ(base64_encode("foob"), "Zm9vYg==");
  EXPECT_EQ(base64_encode("fooba"), "Zm9vYmE=");
  EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(base64_encode(std::string("\xff\xfe\x00", 3)), "//4A");
}

TEST(RunReportText, HtmlEscapeWritesReferencesAndRepairsUtf8) {
  EXPECT_EQ(html_escape("</script><b>"), "&lt;/script&gt;&lt;b&gt;");
  EXPECT_EQ(html_escape("a & \"b\" 'c'"), "a &amp; &quot;b&quot; &#39;c&#39;");
  EXPECT_EQ(html_escape("caf\xc3\xa9 \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xf0\x9f\x98\x80");  // UTF-8 kept
  EXPECT_EQ(html_escape("x\xff y"), "x\xef\xbf\xbd y");                                   // not UTF-8: U+FFFD
  EXPECT_EQ(html_escape(std::string("a\x1b[0m\tb\n", 8)), "a\\x1b[0m\tb\n");
}

TEST(RunReportText, EmaIsTheProgressLinesSmoothing) {
  const std::vector<double> v = {1.0, std::nan(""), 3.0, 2.0};
  const auto s = ema_smooth(v, 0.05);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_DOUBLE_EQ(s[0], 1.0);
  EXPECT_DOUBLE_EQ(s[1], 1.0);
  EXPECT_DOUBLE_EQ(s[2], 0.95 * 1.0 + 0.05 * 3.0);
  EXPECT_DOUBLE_EQ(s[3], 0.95 * s[2] + 0.05 * 2.0);
  EXPECT_TRUE(std::isnan(ema_smooth({std::nan("")})[0]));
}

TEST(RunReportText, DownsamplingKeepsEachBinsExtremesWithinTheBound) {
  std::vector<std::pair<double, double>> pts;
  for (int i = 0; i < 100000; ++i) pts.emplace_back(i, std::sin(i * 0.001));
  pts[12345].second = 50;   // a spike
  pts[77777].second = -50;  // and a dip
  const auto kept = downsample_min_max(pts, 2000);
  EXPECT_LE(kept.size(), 2000u);
  EXPECT_GE(kept.size(), 1000u);
  bool spike = false, dip = false;
  for (size_t i = 0; i < kept.size(); ++i) {
    if (i > 0) {
      EXPECT_LT(kept[i - 1].first, kept[i].first);
    }
    spike |= kept[i] == pts[12345];
    dip |= kept[i] == pts[77777];
  }
  EXPECT_TRUE(spike);
  EXPECT_TRUE(dip);
  EXPECT_EQ(downsample_min_max({{0, 1}, {1, 2}}, 2).size(), 2u);  // short series as they are
  EXPECT_EQ(downsample_min_max(std::vector<std::pair<double, double>>(7, {0, 1}), 3).size(), 1u);  // flat bin: once
  EXPECT_THROW(downsample_min_max(pts, 1), Error);
}

// Every plotted value, read back from its SVG coordinates, is the metric the
// formula gave (the loss's EMA as the progress line computes it); one <svg>
// per plot; hostile text is escaped; the grids are inlined byte for byte.
TEST(RunReport, PlotsDrawTheMetricsAndEscapeText) {
  const std::string dir = fake_run("plots", 50, 2);
  const std::string path = write_run_report(dir, std::string("CPU: test ") + kHostile);
  EXPECT_EQ(path, dir + "/report.html");
  const std::string html = read_text(path);
  EXPECT_EQ(count_of(html, "<svg class=\"plot\""), 5u);
  for (const char* id : {"plot-loss", "plot-lr", "plot-grad-norm", "plot-images-per-second", "plot-memory"}) {
    EXPECT_EQ(count_of(html, std::string("id=\"") + id + "\""), 1u) << id;
  }

  std::vector<std::pair<double, double>> loss, ema, lr, norm, ips, act, total, weights;
  double s = std::nan("");
  for (int i = 1; i <= 50; ++i) {
    if (i != 7) {
      loss.emplace_back(i, loss_at(i));
      s = std::isnan(s) ? loss_at(i) : 0.95 * s + 0.05 * loss_at(i);
    }
    ema.emplace_back(i, s);
    lr.emplace_back(i, lr_at(i));
    norm.emplace_back(i, norm_at(i));
    ips.emplace_back(i, ips_at(i));
    act.emplace_back(i, static_cast<double>(activations_at(i)) / kMiB);
    total.emplace_back(i, static_cast<double>(total_at(i)) / kMiB);
    weights.emplace_back(i, 4.0);
  }
  const Plot lp = plot_of(html, "plot-loss");
  EXPECT_EQ(lp.attrs.at("data-y-scale"), "log");  // 0.016 .. 0.82: wider than 20x
  expect_near_series(lp.series.at("loss"), loss, 2e-3, true);
  expect_near_series(lp.series.at("loss_ema"), ema, 2e-3, true);
  EXPECT_NE(html.find("1 non-finite loss(es) not drawn"), std::string::npos);
  const Plot rp = plot_of(html, "plot-lr");
  EXPECT_EQ(rp.attrs.at("data-y-scale"), "linear");
  expect_near_series(rp.series.at("lr"), lr, 1e-6, false);
  expect_near_series(plot_of(html, "plot-grad-norm").series.at("grad_norm"), norm, 2e-3, false);
  expect_near_series(plot_of(html, "plot-images-per-second").series.at("images_per_second"), ips, 0.02, false);
  const Plot mp = plot_of(html, "plot-memory");
  expect_near_series(mp.series.at("activations"), act, 0.01, false);
  expect_near_series(mp.series.at("weights"), weights, 0.01, false);
  expect_near_series(mp.series.at("total"), total, 0.01, false);
  EXPECT_FALSE(mp.series.count("optimizer_state"));  // always 0: named in the note instead
  EXPECT_FALSE(mp.series.count("device_total"));     // the same as total on the CPU
  EXPECT_NE(html.find("always 0: optimizer_state, temporaries, other, host_offload"), std::string::npos);

  // The torn line is counted, not fatal.
  EXPECT_NE(html.find("1 unreadable line(s)"), std::string::npos);
  // Hostile text (config, prompts, machine) never reaches the page raw.
  EXPECT_EQ(html.find("<b>bold"), std::string::npos);
  EXPECT_EQ(count_of(html, "</script>"), 0u);
  EXPECT_EQ(count_of(html, "&lt;/script&gt;&lt;b&gt;bold&lt;/b&gt;&quot;&#39;&amp;"), 3u);  // config, prompt set, machine
  // Both grids inlined, byte for byte, with their steps.
  for (const char* stem : {"step-000010", "step-000020"}) {
    const std::string png = read_text(fs::path(dir) / "samples" / (std::string(stem) + ".png"));
    EXPECT_NE(html.find("data:image/png;base64," + base64_encode(png) + "\""), std::string::npos) << stem;
  }
  EXPECT_NE(html.find("<figcaption>step 20</figcaption>"), std::string::npos);
  fs::remove_all(dir);
}

// A long run: each series at most max_points points, the extremes kept;
// grids past max_grids / max_inline_bytes are linked, not inlined.
TEST(RunReport, LongRunsStayBounded) {
  const std::string dir = fake_run("long", 20000, 30, 500);
  RunReportOptions o;
  o.max_points = 400;
  o.max_grids = 5;
  const std::string html = render_run_report(read_run_report_inputs(dir, "CPU: test"), o);
  const Plot lp = plot_of(html, "plot-loss");
  for (const auto& [name, pts] : lp.series) {
    EXPECT_LE(pts.size(), 400u) << name;
    EXPECT_GE(pts.size(), 200u) << name;
  }
  EXPECT_EQ(lp.total.at("loss"), 19999u);  // every finite one counted
  double lo = 1e9, hi = 0;
  for (const auto& p : lp.series.at("loss")) {
    lo = std::min(lo, p.second);
    hi = std::max(hi, p.second);
  }
  EXPECT_NEAR(hi, loss_at(1), 2e-3 * loss_at(1));
  EXPECT_NEAR(lo, loss_at(20000), 2e-3 * loss_at(20000));
  EXPECT_EQ(count_of(html, "<img class=\"sample-grid\""), 5u);
  // first, last and three between, in step order; the other 25 linked
  EXPECT_NE(html.find("alt=\"sample grid at step 500\""), std::string::npos);
  EXPECT_NE(html.find("alt=\"sample grid at step 15000\""), std::string::npos);
  EXPECT_EQ(count_of(html, "<a href=\"samples/step-"), 25u);
  EXPECT_LT(html.size(), size_t{400} << 10);

  // A byte budget of one grid: the newest only.
  o.max_inline_bytes = static_cast<int64_t>(fs::file_size(fs::path(dir) / "samples" / "step-015000.png"));
  const std::string one = render_run_report(read_run_report_inputs(dir, "CPU: test"), o);
  EXPECT_EQ(count_of(one, "<img class=\"sample-grid\""), 1u);
  EXPECT_NE(one.find("alt=\"sample grid at step 15000\""), std::string::npos);
  o.max_points = 3;
  EXPECT_THROW(render_run_report(read_run_report_inputs(dir, "CPU: test"), o), Error);
  fs::remove_all(dir);
}

// The page is replaced by a whole new one (no temporary left); a folder
// without metrics.jsonl is no run.
TEST(RunReport, RewritesAtomicallyAndRefusesNonRunFolders) {
  const std::string dir = fake_run("atomic", 5, 0);
  write_run_report(dir, "first machine");
  EXPECT_NE(read_text(dir + "/report.html").find("first machine"), std::string::npos);
  EXPECT_NE(read_text(dir + "/report.html").find("no sample grids yet"), std::string::npos);
  write_run_report(dir, "second machine");
  const std::string html = read_text(dir + "/report.html");
  EXPECT_EQ(html.find("first machine"), std::string::npos);
  EXPECT_NE(html.find("second machine"), std::string::npos);
  EXPECT_EQ(html.substr(html.size() - 8), "</html>\n");
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"config.toml", "metrics.jsonl", "report.html", "samples"}));
  const std::string empty = temp_dir("not_a_run");
  fs::create_directories(empty);
  try {
    write_run_report(empty, "m");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a run folder"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(fs::path(empty) / "report.html"));
  fs::remove_all(dir);
  fs::remove_all(empty);
}

// train() writes the page at each checkpoint / grid, and a resumed run's
// page draws every step of metrics.jsonl, the earlier invocation's too.
TEST(RunReport, TrainingWritesItAndAResumeRedrawsEveryStep) {
  TrainConfig c = shoestring::testing::tiny_emoji_config(temp_dir("train"));
  c.max_train_steps = 4;
  c.save_every_n_steps = 2;
  c.sample_every_n_steps = 2;
  const TrainSummary a = train(c, shoestring::testing::quiet());
  std::string html = read_text(a.run_dir + "/report.html");
  EXPECT_EQ(plot_of(html, "plot-loss").series.at("loss").size(), 4u);
  EXPECT_EQ(count_of(html, "<img class=\"sample-grid\""), 2u);
  EXPECT_NE(html.find("device cpu"), std::string::npos);
  EXPECT_NE(html.find("max_train_steps = 4"), std::string::npos);

  TrainRunOptions resume = shoestring::testing::quiet();
  resume.resume_dir = a.run_dir;
  c.max_train_steps = 6;
  train(c, resume);
  html = read_text(a.run_dir + "/report.html");
  const auto losses = shoestring::testing::losses_of(a.run_dir + "/metrics.jsonl");
  ASSERT_EQ(losses.size(), 6u);
  const Plot lp = plot_of(html, "plot-loss");
  ASSERT_EQ(lp.series.at("loss").size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(lp.series.at("loss")[i].second, losses[i], 2e-3 * losses[i]) << i;
  EXPECT_EQ(count_of(html, "<img class=\"sample-grid\""), 3u);
  fs::remove_all(a.run_dir);
}

/// The event files of RUN_DIR/logs, oldest first (their names start with the Unix time, then host and pid).
std::vector<std::string> event_files(const std::string& run_dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fs::path(run_dir) / "logs")) out.push_back(e.path().string());
  std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    return fs::last_write_time(a) < fs::last_write_time(b);
  });
  return out;
}

/// The bytes of a Summary.Value{tag, simple_value} as event_scalars encodes them.
std::string scalar_bytes(const std::string& tag, float v) {
  std::string out = "\x0a" + std::string(1, static_cast<char>(tag.size())) + tag + "\x15";
  out.append(reinterpret_cast<const char*>(&v), 4);
  return out;
}

// log_with = "tensorboard": each step's metrics as scalars in RUN_DIR/logs,
// the loss equal to metrics.jsonl's (as a float); a resume opens a second
// file that starts with SessionLog START at its first step.
TEST(RunReport, TensorBoardEventsFollowTheMetrics) {
  TrainConfig c = shoestring::testing::tiny_emoji_config(temp_dir("tensorboard"));
  c.max_train_steps = 3;
  c.log_with = "tensorboard";
  const TrainSummary a = train(c, shoestring::testing::quiet());
  auto files = event_files(a.run_dir);
  ASSERT_EQ(files.size(), 1u);
  auto records = read_tfrecords(files[0]);
  ASSERT_EQ(records.size(), 4u);  // file_version + 3 steps
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  auto losses = shoestring::testing::losses_of(a.run_dir + "/metrics.jsonl");
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NE(records[i + 1].find(scalar_bytes("train/loss", static_cast<float>(losses[i]))), std::string::npos) << i;
    EXPECT_NE(records[i + 1].find(std::string("\x10") + static_cast<char>(i + 1)), std::string::npos);  // step
    EXPECT_NE(records[i + 1].find("memory/peak_activations_MiB"), std::string::npos);
  }
  TrainRunOptions resume = shoestring::testing::quiet();
  resume.resume_dir = a.run_dir;
  c.max_train_steps = 5;
  train(c, resume);
  files = event_files(a.run_dir);
  ASSERT_EQ(files.size(), 2u);
  records = read_tfrecords(files[1]);
  ASSERT_EQ(records.size(), 4u);  // file_version, START at step 4, steps 4 and 5
  EXPECT_NE(records[1].find(std::string("\x10\x04\x3a\x02\x08\x01", 6)), std::string::npos);
  losses = shoestring::testing::losses_of(a.run_dir + "/metrics.jsonl");
  EXPECT_NE(records[3].find(scalar_bytes("train/loss", static_cast<float>(losses[4]))), std::string::npos);
  fs::remove_all(a.run_dir);
}

// Headless Chromium (Debian's `chromium`) renders the page: the DOM holds
// the plots, and the screenshot shows the loss line's colour and the grids.
TEST(RunReport, RendersInHeadlessChromium) {
  if (std::system("command -v chromium >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "chromium is not installed (apt-get install chromium; scripts/setup.sh installs it)";
  }
  const std::string dir = fake_run("chromium", 300, 3);
  const std::string path = write_run_report(dir, "CPU: test");
  const std::string shot = dir + "/screenshot.png", dom = dir + "/dom.html";
  const std::string flags = "--headless --disable-gpu --no-sandbox --hide-scrollbars --window-size=1200,3000 "
                            "--user-data-dir=" + dir + "/profile";
  const std::string url = "file://" + fs::absolute(path).string();
  ASSERT_EQ(std::system(("timeout 120 chromium " + flags + " --screenshot=" + shot + " " + url + " >/dev/null 2>&1")
                            .c_str()),
            0);
  ASSERT_EQ(std::system(("timeout 120 chromium " + flags + " --dump-dom " + url + " >" + dom + " 2>/dev/null").c_str()),
            0);
  const std::string parsed = read_text(dom);
  EXPECT_EQ(count_of(parsed, "<svg class=\"plot\""), 5u);
  EXPECT_GE(count_of(parsed, "<polyline class=\"series\""), 9u);
  EXPECT_EQ(count_of(parsed, "<img class=\"sample-grid\""), 3u);
  EXPECT_EQ(parsed.find("<b>bold"), std::string::npos);  // the escaped config stayed text

  int w = 0, h = 0, n = 0;
  unsigned char* px = stbi_load(shot.c_str(), &w, &h, &n, 3);
  ASSERT_NE(px, nullptr) << shot;
  EXPECT_EQ(w, 1200);
  int64_t loss_blue = 0, non_white = 0;
  std::set<uint32_t> colours;
  for (int64_t i = 0; i < static_cast<int64_t>(w) * h; ++i) {
    const int r = px[3 * i], g = px[3 * i + 1], b = px[3 * i + 2];
    if (r < 40 && std::abs(g - 114) < 30 && std::abs(b - 178) < 30) ++loss_blue;  // #0072b2, the first series
    if (r < 250 || g < 250 || b < 250) ++non_white;
    colours.insert(static_cast<uint32_t>(r << 16 | g << 8 | b));
  }
  stbi_image_free(px);
  EXPECT_GT(loss_blue, 2000) << "the plots' first series should be drawn in #0072b2";
  EXPECT_GT(non_white, 50000);
  EXPECT_GT(colours.size(), 50u);
  fs::remove_all(dir);
}
