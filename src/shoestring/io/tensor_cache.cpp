#include "shoestring/io/tensor_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <list>
#include <set>

#include <nlohmann/json.hpp>

#include "shoestring/core/content_hash.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "shoestring.tensor_cache";
constexpr int kVersion = 1;
constexpr const char* kEntriesKey = "shoestring.cache_entries";
constexpr const char* kKindKey = "shoestring.cache_kind";
constexpr size_t kOpenShards = 4;  // shards kept mapped by read()


bool plain_name(const std::string& s) {
  if (s.empty()) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

/// The writer and sequence number of a shard file name "<writer>-NNNNNN.safetensors".
bool parse_shard_name(const std::string& name, std::string* writer, int64_t* seq) {
  if (!has_suffix(name, ".safetensors")) return false;
  const std::string stem = name.substr(0, name.size() - std::string(".safetensors").size());
  const size_t dash = stem.rfind('-');
  if (dash == std::string::npos || dash == 0 || dash + 1 == stem.size()) return false;
  const std::string digits = stem.substr(dash + 1);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) || digits.size() > 12)
    return false;
  *writer = stem.substr(0, dash);
  *seq = std::stoll(digits);
  return true;
}

void hash_into(uint64_t& h, const void* p, size_t n) { h = content_hash64(p, n, h); }

}  // namespace

uint64_t cache_entry_checksum(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  uint64_t h = 0x63616368655f7631ull;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.is_contiguous() && t.device().is_cpu() ? t : t.contiguous().cpu();
    const std::string dtype = to_string(st_dtype_of(c.scalar_type()));
    const std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
    hash_into(h, name.data(), name.size());
    hash_into(h, dtype.data(), dtype.size());
    hash_into(h, shape.data(), shape.size() * sizeof(int64_t));
    hash_into(h, c.data_ptr(), static_cast<size_t>(c.nbytes()));
  }
  return h;
}

struct TensorCache::State {
  struct Entry {
    size_t shard = 0;
    std::vector<std::string> names;
    uint64_t checksum = 0;
  };
  struct Shard {
    std::string file;    // name inside dir
    std::string writer;  // who wrote it
    std::vector<std::string> keys;
    std::map<std::string, Entry> entries;  // as its manifest / metadata lists them
    bool dropped = false;
  };
  std::string dir, kind, writer;
  std::unique_ptr<FolderLock> lock;
  std::vector<Shard> shards;
  std::map<std::string, Entry> index;
  std::vector<std::string> notes;
  int64_t next_seq = 1;
  // read(): least recently used shard mappings, newest first.
  mutable std::list<std::pair<size_t, SafetensorsFile>> mapped;

  std::string path_of(const Shard& s) const { return (fs::path(dir) / s.file).string(); }
  std::string manifest_path(const std::string& w) const {
    return (fs::path(dir) / ("manifest-" + w + ".json")).string();
  }

  static nlohmann::json entries_json(const std::map<std::string, Entry>& entries) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [key, e] : entries) out[key] = {{"checksum", hex64(e.checksum)}, {"tensors", e.names}};
    return out;
  }

  /// Parses an "entries" object of a manifest or shard; `where` names it in errors.
  static std::map<std::string, Entry> parse_entries(const nlohmann::json& j, const std::string& where) {
    if (!j.is_object()) fail("{}: \"entries\" must be an object of key -> {{checksum, tensors}}", where);
    std::map<std::string, Entry> out;
    for (const auto& [key, v] : j.items()) {
      if (!plain_name(key)) fail("{}: entry key '{}' is not a plain name", where, key);
      if (!v.is_object() || !v.contains("checksum") || !v["checksum"].is_string() || !v.contains("tensors") ||
          !v["tensors"].is_array()) {
        fail("{}: entry '{}' must hold \"checksum\" (16 hex digits) and \"tensors\" (names)", where, key);
      }
      Entry e;
      if (!parse_hex64(v["checksum"].get<std::string>(), &e.checksum))
        fail("{}: entry '{}': checksum '{}' is not 16 hex digits", where, key, v["checksum"].get<std::string>());
      for (const auto& n : v["tensors"]) {
        if (!n.is_string() || !plain_name(n.get<std::string>()))
          fail("{}: entry '{}': tensor names must be plain names", where, key);
        e.names.push_back(n.get<std::string>());
      }
      if (e.names.empty()) fail("{}: entry '{}' names no tensors", where, key);
      out.emplace(key, std::move(e));
    }
    return out;
  }

  void add_shard(Shard s) {
    const size_t i = shards.size();
    for (auto& [key, e] : s.entries) {
      e.shard = i;
      s.keys.push_back(key);
      index[key] = e;  // a later shard's copy wins
    }
    shards.push_back(std::move(s));
  }

  void write_manifest() const {
    nlohmann::json list = nlohmann::json::array();
    for (const Shard& s : shards) {
      if (s.writer != writer || s.dropped) continue;
      list.push_back({{"file", s.file}, {"entries", entries_json(s.entries)}});
    }
    nlohmann::json m = {
        {"format", kFormat}, {"version", kVersion}, {"kind", kind}, {"writer", writer}, {"shards", list}};
    write_bytes_atomic(manifest_path(writer), m.dump(1) + "\n");
  }

  void drop(size_t i, bool delete_file) {
    Shard& s = shards[i];
    s.dropped = true;
    for (const std::string& key : s.keys) {
      auto it = index.find(key);
      if (it == index.end() || it->second.shard != i) continue;
      index.erase(it);
      // Another shard's copy of the entry (the newest one left) stands in.
      for (size_t j = shards.size(); j-- > 0;) {
        if (j == i || shards[j].dropped) continue;
        auto other = shards[j].entries.find(key);
        if (other == shards[j].entries.end()) continue;
        index.emplace(key, other->second);
        break;
      }
    }
    mapped.remove_if([i](const auto& m) { return m.first == i; });
    if (delete_file && s.writer == writer && !writer.empty()) {
      std::error_code ec;
      fs::remove(path_of(s), ec);
      write_manifest();
    }
  }

  const SafetensorsFile& mapping(size_t i) const {
    for (auto it = mapped.begin(); it != mapped.end(); ++it) {
      if (it->first == i) {
        mapped.splice(mapped.begin(), mapped, it);
        return mapped.front().second;
      }
    }
    mapped.emplace_front(i, SafetensorsFile::open(path_of(shards[i])));
    while (mapped.size() > kOpenShards) mapped.pop_back();
    return mapped.front().second;
  }
};

TensorCache::TensorCache(std::unique_ptr<State> s) : s_(std::move(s)) {}
TensorCache::TensorCache(TensorCache&&) noexcept = default;
TensorCache& TensorCache::operator=(TensorCache&&) noexcept = default;
TensorCache::~TensorCache() = default;

TensorCache TensorCache::open(const std::string& dir, const std::string& kind, const std::string& writer) {
  auto s = std::make_unique<State>();
  s->dir = dir;
  s->kind = kind;
  s->writer = writer;
  if (!writer.empty() && !plain_name(writer))
    fail("tensor cache {}: writer name '{}' is not a plain name", dir, writer);
  if (!writer.empty()) {
    ensure_writable_dir(dir);
    s->lock = std::make_unique<FolderLock>(dir, ".lock-" + writer);
    const std::string own_prefix = writer + "-";
    const std::string own_manifest = "manifest-" + writer + ".json";
    StaleTemporaries stale = remove_temporaries(dir, [&](const std::string& name) {
      return name == own_manifest || name == ".write_probe" ||
             (has_prefix(name, own_prefix) && has_suffix(name, ".safetensors"));
    });
    for (const std::string& p : stale.paths)
      s->notes.push_back(fmt::format("removed {} (left by an interrupted write)", p));
  } else if (!fs::is_directory(dir)) {
    return TensorCache(std::move(s));  // nothing cached yet
  }

  // Every writer's manifest, in name order.
  std::vector<std::string> manifests, shard_files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file()) continue;
    if (has_prefix(name, "manifest-") && has_suffix(name, ".json")) manifests.push_back(name);
    std::string w;
    int64_t seq = 0;
    if (parse_shard_name(name, &w, &seq)) {
      shard_files.push_back(name);
      if (w == writer) s->next_seq = std::max(s->next_seq, seq + 1);
    }
  }
  if (ec) fail("tensor cache {}: cannot list the folder: {}", dir, ec.message());
  std::sort(manifests.begin(), manifests.end());
  std::sort(shard_files.begin(), shard_files.end());
  std::set<std::string> listed;
  for (const std::string& name : manifests) {
    const std::string path = (fs::path(dir) / name).string();
    nlohmann::json m;
    try {
      m = nlohmann::json::parse(read_file(path));
    } catch (const nlohmann::json::exception& e) {
      fail("{}: not valid JSON ({}); delete the file to let the cache adopt its shards again", path, e.what());
    }
    // A manifest is untrusted text: a key of the wrong JSON type is refused
    // by name, never read through nlohmann's throwing conversions.
    const auto field = [&m](const char* key) { return m.is_object() && m.contains(key) ? m[key] : nlohmann::json(); };
    if (field("format") != kFormat)
      fail("{}: \"format\" must be \"{}\" (not a shoestring cache manifest)", path, kFormat);
    if (field("version") != kVersion)
      fail("{}: \"version\" {} is not {} (written by another shoestring version)", path, field("version").dump(),
           kVersion);
    if (field("kind") != kind)
      fail("{}: key \"kind\" is {}, expected \"{}\" (another cache's folder)", path, field("kind").dump(), kind);
    const std::string w = name.substr(9, name.size() - 9 - 5);
    if (!m.contains("shards") || !m["shards"].is_array()) fail("{}: key \"shards\" must be an array", path);
    for (size_t i = 0; i < m["shards"].size(); ++i) {
      const nlohmann::json& sh = m["shards"][i];
      const std::string where = fmt::format("{}: shards[{}]", path, i);
      if (!sh.is_object() || !sh.contains("file") || !sh["file"].is_string())
        fail("{}: needs \"file\" (a shard name)", where);
      State::Shard shard;
      shard.file = sh["file"].get<std::string>();
      std::string fw;
      int64_t seq = 0;
      if (!parse_shard_name(shard.file, &fw, &seq) || fw != w)
        fail("{}: \"file\" '{}' is not a shard of writer '{}' (<writer>-NNNNNN.safetensors)", where, shard.file, w);
      shard.writer = w;
      shard.entries = State::parse_entries(sh.value("entries", nlohmann::json()), where);
      listed.insert(shard.file);
      s->add_shard(std::move(shard));
    }
  }
  // Shards written by a process killed before its manifest: their own
  // metadata lists their entries.
  bool adopted_own = false;
  for (const std::string& name : shard_files) {
    if (listed.count(name)) continue;
    const std::string path = (fs::path(dir) / name).string();
    std::string w;
    int64_t seq = 0;
    parse_shard_name(name, &w, &seq);
    try {
      SafetensorsFile f = SafetensorsFile::open(path);
      const auto& meta = f.metadata();
      auto kind_it = meta.find(kKindKey);
      auto entries_it = meta.find(kEntriesKey);
      if (kind_it == meta.end() || entries_it == meta.end())
        fail("{}: no \"{}\" metadata (not a cache shard)", path, kEntriesKey);
      if (kind_it->second != kind) continue;  // another cache's shard: leave it alone
      State::Shard shard;
      shard.file = name;
      shard.writer = w;
      shard.entries = State::parse_entries(nlohmann::json::parse(entries_it->second), path);
      s->notes.push_back(
          fmt::format("adopted {} ({} entries; its manifest update was interrupted)", path, shard.entries.size()));
      adopted_own = adopted_own || w == writer;
      s->add_shard(std::move(shard));
    } catch (const std::exception& e) {
      // Unreadable and never listed: not trusted, not read.
      s->notes.push_back(fmt::format("ignored {}: {}", path, e.what()));
      if (!writer.empty() && w == writer) {
        fs::remove(path, ec);
        s->notes.back() += " (deleted)";
      }
    }
  }
  if (adopted_own && !writer.empty()) s->write_manifest();
  return TensorCache(std::move(s));
}

const std::string& TensorCache::dir() const { return s_->dir; }
int64_t TensorCache::size() const { return static_cast<int64_t>(s_->index.size()); }
bool TensorCache::contains(const std::string& key) const { return s_->index.count(key) > 0; }
std::vector<std::string> TensorCache::keys() const {
  std::vector<std::string> out;
  out.reserve(s_->index.size());
  for (const auto& [key, e] : s_->index) out.push_back(key);
  return out;
}
std::string TensorCache::shard_of(const std::string& key) const {
  auto it = s_->index.find(key);
  return it == s_->index.end() ? std::string() : s_->path_of(s_->shards[it->second.shard]);
}
const std::vector<std::string>& TensorCache::notes() const { return s_->notes; }

CacheVerifyReport TensorCache::verify(const std::vector<std::string>& keys) {
  CacheVerifyReport report;
  // The shards the index names for `keys`; a failing shard's entries fall
  // back to other shards' copies (State::drop), which are checked in turn.
  std::set<size_t> checked;
  for (;;) {
    std::set<size_t> holding;
    for (const std::string& key : keys) {
      auto it = s_->index.find(key);
      if (it != s_->index.end() && !checked.count(it->second.shard)) holding.insert(it->second.shard);
    }
    if (holding.empty()) break;
    for (const size_t i : holding) {
      checked.insert(i);
      verify_shard(i, report);
    }
  }
  return report;
}

void TensorCache::verify_shard(size_t i, CacheVerifyReport& report) {
  const State::Shard& shard = s_->shards[i];
  const std::string path = s_->path_of(shard);
  // Another user's shard this process may not read is not damaged: refused
  // as it is, so a shared cache never loses entries to a permission problem.
  if (::access(path.c_str(), R_OK) != 0 && (errno == EACCES || errno == EPERM)) {
    fail(
        "{}: this process may not read the cache shard ({}); it is left as it is. Give this user read access to "
        "the cache folder's files, or set cache_dir to a folder of its own",
        path, std::strerror(errno));
  }
  std::string problem;
  try {
    SafetensorsFile f = SafetensorsFile::open(path);
    auto kind_it = f.metadata().find(kKindKey);
    if (kind_it == f.metadata().end() || kind_it->second != s_->kind)
      fail("{}: not a \"{}\" cache shard (metadata {})", path, s_->kind, kKindKey);
    for (const std::string& key : shard.keys) {
      const State::Entry& e = shard.entries.at(key);
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const std::string& n : e.names) tensors.emplace_back(n, f.get(key + "." + n));
      if (cache_entry_checksum(tensors) != e.checksum)
        fail("{}: entry {} does not match its checksum (the file is corrupt)", path, key);
      ++report.entries_checked;
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  ++report.shards_checked;
  if (!problem.empty()) {
    report.problems.push_back(problem);
    report.failed_shards.push_back(path);
    s_->drop(i, /*delete_file=*/true);
  }
}

void TensorCache::exclude_shards(const std::vector<std::string>& paths) {
  const std::set<std::string> excluded(paths.begin(), paths.end());
  for (size_t i = 0; i < s_->shards.size(); ++i) {
    if (!s_->shards[i].dropped && excluded.count(s_->path_of(s_->shards[i]))) s_->drop(i, /*delete_file=*/false);
  }
}

void TensorCache::write_shard(const std::vector<CacheEntry>& entries) {
  if (s_->writer.empty()) fail("tensor cache {}: opened read-only, cannot write a shard", s_->dir);
  if (entries.empty()) return;
  State::Shard shard;
  shard.file = fmt::format("{}-{:06d}.safetensors", s_->writer, s_->next_seq);
  shard.writer = s_->writer;
  std::vector<NamedTensor> named;
  for (const CacheEntry& entry : entries) {
    if (!plain_name(entry.key)) fail("tensor cache {}: entry key '{}' is not a plain name", s_->dir, entry.key);
    if (entry.tensors.empty()) fail("tensor cache {}: entry {} has no tensors", s_->dir, entry.key);
    if (shard.entries.count(entry.key)) fail("tensor cache {}: entry {} given twice", s_->dir, entry.key);
    State::Entry e;
    for (const auto& [name, t] : entry.tensors) {
      if (!plain_name(name))
        fail("tensor cache {}: entry {}: tensor name '{}' is not a plain name", s_->dir, entry.key, name);
      e.names.push_back(name);
      named.push_back({entry.key + "." + name, t.contiguous().cpu(), std::nullopt});
    }
    e.checksum = cache_entry_checksum(entry.tensors);
    shard.entries.emplace(entry.key, std::move(e));
  }
  const std::map<std::string, std::string> meta = {{kKindKey, s_->kind},
                                                   {kEntriesKey, State::entries_json(shard.entries).dump()}};
  save_safetensors(s_->path_of(shard), named, meta);
  ++s_->next_seq;
  s_->add_shard(std::move(shard));
  s_->write_manifest();
}

std::vector<at::Tensor> TensorCache::read(const std::string& key) const {
  auto it = s_->index.find(key);
  if (it == s_->index.end()) fail("tensor cache {}: no entry {}", s_->dir, key);
  const State::Entry& e = it->second;
  const std::string path = s_->path_of(s_->shards[e.shard]);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  const SafetensorsFile* f = nullptr;
  try {
    f = &s_->mapping(e.shard);
  } catch (const Error& err) {
    fail("{}: entry {} cannot be read ({}); run `shoestring cache CONFIG` to encode it again", path, key, err.what());
  }
  // A mapped file cut short would fault (SIGBUS) where its pages are gone:
  // check its size before touching the bytes. (A file deleted while mapped
  // stays readable through the mapping.)
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (!ec && size != f->file_size()) {
    fail(
        "{}: entry {}: the shard is now {} bytes (it held {} when mapped); run `shoestring cache CONFIG` to encode "
        "it again",
        path, key, size, f->file_size());
  }
  try {
    for (const std::string& n : e.names) tensors.emplace_back(n, f->get(key + "." + n).clone());
  } catch (const Error& err) {
    fail("{}: entry {} cannot be read ({}); run `shoestring cache CONFIG` to encode it again", path, key, err.what());
  }
  if (cache_entry_checksum(tensors) != e.checksum) {
    fail(
        "{}: entry {} does not match its checksum (the file changed after it was verified); run `shoestring cache "
        "CONFIG` to encode it again",
        path, key);
  }
  std::vector<at::Tensor> out;
  for (auto& [n, t] : tensors) out.push_back(std::move(t));
  return out;
}

}  // namespace shoestring
