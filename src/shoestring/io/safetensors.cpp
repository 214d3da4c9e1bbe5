#include "shoestring/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <unordered_map>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/core/units.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/json_structure.h"

// The format is little-endian and we use file bytes as they are.
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shoestring's safetensors reader/writer assumes a little-endian machine"
#endif

namespace shoestring {

namespace {

/// Same limit as the reference implementation (safetensors' MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct DtypeRow {
  StDtype dtype;
  const char* name;
  int64_t size;
};

constexpr DtypeRow kDtypes[] = {
    {StDtype::F64, "F64", 8},   {StDtype::F32, "F32", 4},         {StDtype::F16, "F16", 2},
    {StDtype::BF16, "BF16", 2}, {StDtype::F8_E4M3, "F8_E4M3", 1}, {StDtype::F8_E5M2, "F8_E5M2", 1},
    {StDtype::I64, "I64", 8},   {StDtype::I32, "I32", 4},         {StDtype::I16, "I16", 2},
    {StDtype::I8, "I8", 1},     {StDtype::U8, "U8", 1},           {StDtype::BOOL, "BOOL", 1},
};

const DtypeRow& row(StDtype d) {
  for (const auto& r : kDtypes) {
    if (r.dtype == d) return r;
  }
  throw Error(fmt::format("invalid StDtype value {}", static_cast<int>(d)));
}

/// numel of `shape`, or nullopt on int64 overflow.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

/// Read-only private mapping of a whole file; unmapped when the last owner
/// (SafetensorsFile copies and tensors from get()) goes away.
struct Mapping {
  const uint8_t* data = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data) ::munmap(const_cast<uint8_t*>(data), size);
  }
};

std::shared_ptr<Mapping> map_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail("cannot stat safetensors file '{}': {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("safetensors file '{}' is not a regular file", path);
  }
  auto m = std::make_shared<Mapping>();
  m->size = static_cast<size_t>(st.st_size);
  if (m->size < 8) {
    ::close(fd);
    fail(
        "invalid safetensors file '{}': file is shorter than 8 bytes ({} bytes), so it has no "
        "header length",
        path, m->size);
  }
  void* p = ::mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) fail("cannot mmap safetensors file '{}': {}", path, std::strerror(err));
  m->data = static_cast<const uint8_t*>(p);
  return m;
}

/// Nesting a valid header needs: the header object, a tensor entry (or
/// __metadata__), and the entry's "shape" / "data_offsets" arrays. The margin
/// keeps a clear message for near misses (e.g. "shape": [[2]]); the bound
/// keeps a header of nested brackets from costing gigabytes before it fails.
constexpr int kMaxHeaderDepth = 8;

/// A valid header's arrays ("shape", "data_offsets") hold a few numbers each.
/// Bounded for the same reason as the depth.
constexpr size_t kMaxHeaderArrayLength = 1024;

/// "'{'" for a printable ASCII byte, else "byte 0x1b".
std::string describe_byte(unsigned char c) {
  if (c >= 0x20 && c < 0x7f) return fmt::format("'{}'", static_cast<char>(c));
  return fmt::format("byte 0x{:02x}", c);
}

}  // namespace

// ---------------------------------------------------------------------------
// dtypes

const char* to_string(StDtype d) { return row(d).name; }

StDtype st_dtype_from_string(const std::string& s, const std::string& context) {
  for (const auto& r : kDtypes) {
    if (s == r.name) return r.dtype;
  }
  std::vector<std::string> names;
  for (const auto& r : kDtypes) names.emplace_back(r.name);
  fail("{}: unknown dtype '{}' (expected one of {})", context, s, fmt::join(names, ", "));
}

int64_t element_size(StDtype d) { return row(d).size; }

at::ScalarType to_scalar_type(StDtype d) {
  switch (d) {
    case StDtype::F64: return at::kDouble;
    case StDtype::F32: return at::kFloat;
    case StDtype::F16: return at::kHalf;
    case StDtype::BF16: return at::kBFloat16;
#if SHOESTRING_HAS_FLOAT8
    case StDtype::F8_E4M3: return at::kFloat8_e4m3fn;
    case StDtype::F8_E5M2: return at::kFloat8_e5m2;
#else
    case StDtype::F8_E4M3: return at::kByte;
    case StDtype::F8_E5M2: return at::kByte;
#endif
    case StDtype::I64: return at::kLong;
    case StDtype::I32: return at::kInt;
    case StDtype::I16: return at::kShort;
    case StDtype::I8: return at::kChar;
    case StDtype::U8: return at::kByte;
    case StDtype::BOOL: return at::kBool;
  }
  fail("invalid StDtype value {}", static_cast<int>(d));
}

StDtype st_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return StDtype::F64;
    case at::kFloat: return StDtype::F32;
    case at::kHalf: return StDtype::F16;
    case at::kBFloat16: return StDtype::BF16;
#if SHOESTRING_HAS_FLOAT8
    case at::kFloat8_e4m3fn: return StDtype::F8_E4M3;
    case at::kFloat8_e5m2: return StDtype::F8_E5M2;
#endif
    case at::kLong: return StDtype::I64;
    case at::kInt: return StDtype::I32;
    case at::kShort: return StDtype::I16;
    case at::kChar: return StDtype::I8;
    case at::kByte: return StDtype::U8;
    case at::kBool: return StDtype::BOOL;
    default: break;
  }
  fail("libtorch dtype {} has no safetensors equivalent", c10::toString(t));
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------
// reading

struct SafetensorsFile::State {
  std::string path;
  std::shared_ptr<Mapping> mapping;
  uint64_t header_size = 0;
  std::vector<TensorInfo> tensors;
  std::unordered_map<std::string, size_t> index;
  std::map<std::string, std::string> metadata;

  uint64_t data_start() const { return 8 + header_size; }
};

SafetensorsFile::SafetensorsFile(std::shared_ptr<const State> s) : s_(std::move(s)) {}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  using json = nlohmann::json;
  auto st = std::make_shared<State>();
  st->path = path;
  st->mapping = map_file(path);
  const uint8_t* base = st->mapping->data;
  const uint64_t file_size = st->mapping->size;
  const std::string where = fmt::format("invalid safetensors file '{}'", path);

  uint64_t n = 0;
  std::memcpy(&n, base, 8);  // little-endian u64 (see the #error above)
  if (n > kMaxHeaderSize) {
    fail("{}: header length {} exceeds the limit of {} bytes", where, n, kMaxHeaderSize);
  }
  if (n > file_size - 8) {
    fail(
        "{}: header length {} runs past the end of the file ({} bytes, so at most {} bytes "
        "of header)",
        where, n, file_size, file_size - 8);
  }
  st->header_size = n;
  const uint64_t data_size = file_size - 8 - n;

  // Checked before the JSON parser sees the header, so that text that cannot
  // be a header is refused without building it in memory.
  const std::string_view text(reinterpret_cast<const char*>(base + 8), static_cast<size_t>(n));
  if (text.empty() || text.front() != '{') {
    fail("{}: header is not a JSON object: the format requires it to start with '{{' (found {})", where,
         text.empty() ? "an empty header" : describe_byte(static_cast<unsigned char>(text.front())));
  }
  const JsonStructureIssues check = scan_json_structure(text, kMaxHeaderDepth, kMaxHeaderArrayLength);
  if (check.too_deep_at) {
    fail(
        "{}: header nests JSON objects and arrays deeper than {} levels (at byte {} of the header); a "
        "safetensors header needs 3 (the header object, a tensor entry, its \"shape\")",
        where, kMaxHeaderDepth, *check.too_deep_at);
  }
  if (check.syntax_error) fail("{}: header is not valid JSON: {}", where, *check.syntax_error);
  if (check.duplicate_top_key) fail("{}: duplicate tensor name '{}' in the header", where, *check.duplicate_top_key);
  if (check.duplicate_nested_key) {
    fail("{}: duplicate key '{}' in the header entry '{}'", where, check.duplicate_nested_key->second,
         check.duplicate_nested_key->first);
  }
  if (check.long_array) {
    fail("{}: header has an array of more than {} elements (\"shape\" and \"data_offsets\" hold a few numbers)", where,
         kMaxHeaderArrayLength);
  }
  json header;
  try {
    header = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", where, e.what());
  }
  if (!header.is_object()) {
    fail("{}: header is not a JSON object (got {})", where, header.type_name());
  }

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        fail("{}: __metadata__ must be an object mapping strings to strings (got {})", where, entry.type_name());
      }
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) {
          fail(
              "{}: __metadata__ must be an object mapping strings to strings, but the value "
              "of '{}' is {}",
              where, k, v.type_name());
        }
        st->metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    const std::string ctx = fmt::format("{}: tensor '{}'", where, name);
    if (!entry.is_object()) fail("{}: entry is not a JSON object (got {})", ctx, entry.type_name());

    TensorInfo info;
    info.name = name;

    auto dt = entry.find("dtype");
    if (dt == entry.end()) fail("{}: missing \"dtype\"", ctx);
    if (!dt->is_string()) fail("{}: \"dtype\" must be a string (got {})", ctx, dt->type_name());
    info.dtype = st_dtype_from_string(dt->get<std::string>(), ctx);

    auto sh = entry.find("shape");
    if (sh == entry.end()) fail("{}: missing \"shape\"", ctx);
    if (!sh->is_array()) {
      fail("{}: \"shape\" must be an array of integers (got {})", ctx, sh->type_name());
    }
    for (const auto& d : *sh) {
      if (!d.is_number_integer()) {
        fail("{}: \"shape\" must be an array of integers (found {})", ctx, d.dump());
      }
      if (d.is_number_unsigned()) {
        uint64_t u = d.get<uint64_t>();
        if (u > static_cast<uint64_t>(INT64_MAX)) fail("{}: shape dimension {} is too large", ctx, u);
        info.shape.push_back(static_cast<int64_t>(u));
      } else {
        int64_t v = d.get<int64_t>();
        if (v < 0) fail("{}: \"shape\" has negative dimension {}", ctx, v);
        info.shape.push_back(v);
      }
    }

    auto off = entry.find("data_offsets");
    if (off == entry.end()) fail("{}: missing \"data_offsets\"", ctx);
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
      fail("{}: \"data_offsets\" must be an array of two non-negative integers (got {})", ctx, off->dump());
    }
    info.begin = (*off)[0].get<uint64_t>();
    info.end = (*off)[1].get<uint64_t>();
    if (info.begin > info.end) {
      fail("{}: data_offsets [{}, {}] have begin greater than end", ctx, info.begin, info.end);
    }

    auto numel = checked_numel(info.shape);
    int64_t need = 0;
    if (!numel || __builtin_mul_overflow(*numel, element_size(info.dtype), &need)) {
      fail("{}: shape {} is too large", ctx, format_shape(info.shape));
    }
    if (info.end - info.begin != static_cast<uint64_t>(need)) {
      fail(
          "{}: data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {} bytes "
          "(byte size does not match shape and dtype)",
          ctx, info.begin, info.end, info.end - info.begin, format_shape(info.shape), to_string(info.dtype), need);
    }
    st->tensors.push_back(std::move(info));
  }

  // The data buffer must be covered exactly: sorted by offset, each tensor
  // starts where the previous one ended, from 0 to the buffer size.
  std::sort(st->tensors.begin(), st->tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  uint64_t pos = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : st->tensors) {
    if (t.end > data_size) {
      fail(
          "{}: tensor '{}': data_offsets [{}, {}] run past the end of the file (the data buffer "
          "holds {} bytes)",
          where, t.name, t.begin, t.end, data_size);
    }
    if (t.begin < pos) {
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' (which ends at {})", where, t.name, t.begin,
           t.end, prev->name, pos);
    }
    if (t.begin > pos) {
      if (prev) {
        fail(
            "{}: tensor '{}': data_offsets [{}, {}] leave a hole of {} bytes after tensor '{}' "
            "(which ends at {})",
            where, t.name, t.begin, t.end, t.begin - pos, prev->name, pos);
      }
      fail(
          "{}: tensor '{}': data_offsets [{}, {}] leave a hole of {} bytes at the start of the "
          "data buffer",
          where, t.name, t.begin, t.end, t.begin);
    }
    pos = t.end;
    prev = &t;
  }
  if (pos != data_size) {
    fail(
        "{}: the data buffer holds {} bytes but the tensors cover only {} (leaving a hole of {} "
        "unused bytes at the end)",
        where, data_size, pos, data_size - pos);
  }

  for (size_t i = 0; i < st->tensors.size(); ++i) st->index.emplace(st->tensors[i].name, i);
  return SafetensorsFile(std::move(st));
}

const std::string& SafetensorsFile::path() const { return s_->path; }
const std::vector<TensorInfo>& SafetensorsFile::tensors() const { return s_->tensors; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return s_->metadata; }
uint64_t SafetensorsFile::file_size() const { return s_->mapping->size; }
uint64_t SafetensorsFile::header_size() const { return s_->header_size; }
uint64_t SafetensorsFile::data_size() const { return file_size() - s_->data_start(); }

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = s_->index.find(name);
  return it == s_->index.end() ? nullptr : &s_->tensors[it->second];
}

std::string_view SafetensorsFile::bytes(const TensorInfo& info) const {
  const char* p = reinterpret_cast<const char*>(s_->mapping->data + s_->data_start() + info.begin);
  return std::string_view(p, static_cast<size_t>(info.nbytes()));
}

at::Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info) fail("safetensors file '{}' has no tensor '{}'", s_->path, name);
  return get(*info);
}

at::Tensor SafetensorsFile::get(const TensorInfo& info) const {
  const auto options = at::TensorOptions().dtype(to_scalar_type(info.dtype)).device(at::kCPU);
  if (info.nbytes() == 0) return at::empty(info.shape, options);
  std::string_view raw = bytes(info);
  if (info.dtype == StDtype::BOOL) {
    // libtorch assumes bool bytes are 0 or 1; anything else is undefined.
    for (char c : raw) {
      if (static_cast<unsigned char>(c) > 1) {
        fail(
            "invalid safetensors file '{}': tensor '{}': BOOL data holds byte {} (expected 0 or "
            "1)",
            s_->path, info.name, static_cast<unsigned>(static_cast<unsigned char>(c)));
      }
    }
  }
  auto addr = reinterpret_cast<uintptr_t>(raw.data());
  if (addr % static_cast<uintptr_t>(element_size(info.dtype)) == 0) {
    std::shared_ptr<Mapping> keep = s_->mapping;
    return at::from_blob(
        const_cast<char*>(raw.data()), info.shape, [keep](void*) mutable { keep.reset(); }, options);
  }
  // Misaligned for its element type (possible in files from other writers):
  // copy into a fresh, aligned tensor.
  at::Tensor t = at::empty(info.shape, options);
  std::memcpy(t.data_ptr(), raw.data(), raw.size());
  return t;
}

std::map<std::string, at::Tensor> load_safetensors(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& info : file.tensors()) out.emplace(info.name, file.get(info).clone());
  return out;
}

// ---------------------------------------------------------------------------
// writing

void save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Item {
    std::string name;
    StDtype dtype;
    at::Tensor src;  // detached, any device / layout; copied at write time
    uint64_t nbytes;
    std::optional<at::ScalarType> cast;
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  std::set<std::string> seen;
  for (const auto& nt : tensors) {
    if (nt.name.empty()) fail("cannot save '{}': a tensor has an empty name", path);
    if (nt.name == "__metadata__") {
      fail("cannot save '{}': '__metadata__' is reserved and cannot be a tensor name", path);
    }
    if (!seen.insert(nt.name).second) fail("cannot save '{}': duplicate tensor name '{}'", path, nt.name);
    if (!nt.tensor.defined()) fail("cannot save '{}': tensor '{}' is undefined", path, nt.name);
    StDtype dtype;
    try {
      dtype = nt.dtype ? *nt.dtype : st_dtype_of(nt.tensor.scalar_type());
    } catch (const Error& e) {
      fail("cannot save '{}': tensor '{}': {}", path, nt.name, e.what());
    }
    at::Tensor t = nt.tensor.detach();
    if (nt.cast) {
      if (!nt.dtype) dtype = st_dtype_of(*nt.cast);
      // Converted at write time, one tensor at a time; meta shapes are enough here.
      t = at::empty(t.sizes(), t.options().device(at::kMeta).dtype(*nt.cast));
    }
    const int64_t have_elem = static_cast<int64_t>(t.element_size());
    const uint64_t have = static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(have_elem);
    const uint64_t need = static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(element_size(dtype));
    if (have != need || have_elem != element_size(dtype)) {
      fail(
          "cannot save '{}': tensor '{}' of libtorch dtype {} has {}-byte elements, but the "
          "declared dtype {} needs {}-byte elements (byte size does not match the declared "
          "dtype)",
          path, nt.name, c10::toString(t.scalar_type()), have_elem, to_string(dtype), element_size(dtype));
    }
    items.push_back({nt.name, dtype, nt.cast ? nt.tensor.detach() : std::move(t), have, nt.cast});
  }
  // Larger elements first keeps every tensor aligned to its element size,
  // given an 8-aligned data buffer.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return element_size(a.dtype) > element_size(b.dtype); });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) md[k] = v;
    header["__metadata__"] = std::move(md);
  }
  uint64_t offset = 0;
  for (const auto& it : items) {
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = to_string(it.dtype);
    e["shape"] = it.src.sizes().vec();
    e["data_offsets"] = {offset, offset + it.nbytes};
    header[it.name] = std::move(e);
    offset += it.nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("cannot save '{}': a tensor name or metadata string is not valid UTF-8: {}", path, e.what());
  }
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  const uint64_t n = text.size();

  write_file_atomic(path, [&](std::FILE* f) {
    auto put = [&](const void* p, size_t size, const std::string& what) {
      if (size != 0 && std::fwrite(p, 1, size, f) != size) {
        fail("cannot write {} of '{}': {}", what, path, std::strerror(errno));
      }
    };
    put(&n, 8, "the header length");
    put(text.data(), text.size(), "the header");
    // One tensor at a time on the CPU, so saving from an accelerator needs at
    // most one tensor's worth of extra host memory.
    for (const auto& it : items) {
      if (it.nbytes == 0) continue;
      at::Tensor c = it.src.to(at::kCPU).contiguous();
      if (it.cast) c = c.to(*it.cast);
      put(c.data_ptr(), static_cast<size_t>(it.nbytes), fmt::format("tensor '{}'", it.name));
    }
  });
}

}  // namespace shoestring
