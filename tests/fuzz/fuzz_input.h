// One fuzz input through the readers of untrusted files: SafetensorsFile
// (io/safetensors.h), the sharded-checkpoint index WeightFiles
// (io/weight_files.h) and the disk caches' TensorCache (io/tensor_cache.h). Shared by the libFuzzer target
// (fuzz_readers.cpp) and the regression test that replays the committed inputs (tests/io/ test_fuzz_regressions.cpp),
// so both run exactly the same code.
//
// Input layout (byte 0 picks the reader):
//   byte 0 = 0 mod 4: bytes 1.. are a .safetensors file;
//   byte 0 odd:       bytes 1..4 are a little-endian u32 L, then L bytes of
//                     index JSON (written as model.safetensors.index.json),
//                     then the rest as the shard file "s.safetensors" beside it;
//   byte 0 = 2 mod 4: the same split into a cache manifest (cache/manifest-r0.json)
//                     and its shard (cache/r0-000001.safetensors), opened to
//                     read, every entry verified and read, then opened as the
//                     writer (which deletes what it refuses) and verified again.
#pragma once
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/tensor_cache.h"
#include "shoestring/io/weight_files.h"

namespace shoestring::fuzz {

inline void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

/// The oracle for an accepted file: written back with save_safetensors and
/// read again, it holds the same metadata and the same tensors (name, dtype,
/// shape, bytes). Throws std::logic_error (a finding) when it does not.
inline void round_trip(const SafetensorsFile& file, const std::string& path) {
  std::vector<NamedTensor> tensors;
  for (const auto& t : file.tensors()) tensors.push_back({t.name, file.get(t), t.dtype});
  try {
    save_safetensors(path, tensors, file.metadata());
  } catch (const Error& e) {
    throw std::logic_error(std::string("an accepted file cannot be written back: ") + e.what());
  }
  const SafetensorsFile again = SafetensorsFile::open(path);
  if (again.metadata() != file.metadata()) throw std::logic_error("metadata changed in a round trip");
  if (again.tensors().size() != file.tensors().size()) throw std::logic_error("tensor count changed in a round trip");
  for (const auto& t : file.tensors()) {
    const TensorInfo* u = again.find(t.name);
    if (!u || u->dtype != t.dtype || u->shape != t.shape || again.bytes(*u) != file.bytes(t)) {
      throw std::logic_error("tensor '" + t.name + "' changed in a round trip");
    }
  }
}

/// Reads the input through the chosen reader in the folder `dir` (existing,
/// writable; its files are overwritten), touches every tensor it lists and,
/// for an accepted safetensors file of at most 64 KiB of data, checks that it
/// round-trips (round_trip).
/// Returns normally for an accepted file; throws what the reader throws
/// (shoestring::Error for a refused one: anything else is a bug), after
/// checking that the refusal names the file it refused (the project's rule
/// for bad input): a message without the input's file name is a finding.
inline void read_fuzz_input_unchecked(const uint8_t* data, size_t size, const std::filesystem::path& dir);

inline void read_fuzz_input(const uint8_t* data, size_t size, const std::filesystem::path& dir) {
  try {
    read_fuzz_input_unchecked(data, size, dir);
  } catch (const Error& e) {
    const std::string what = e.what();
    // The files live in `dir`; an index names its shards, which may lie elsewhere.
    if (what.find(dir.string()) == std::string::npos &&
        what.find("model.safetensors.index.json") == std::string::npos) {
      throw std::logic_error("a refusal that names no file: " + what);
    }
    throw;
  }
}

inline void read_fuzz_input_unchecked(const uint8_t* data, size_t size, const std::filesystem::path& dir) {
  if (size == 0) return;
  const bool index = data[0] & 1;
  const bool cache = (data[0] & 3) == 2;
  ++data, --size;
  if (cache) {
    uint32_t len = 0;
    if (size < 4) return;
    std::memcpy(&len, data, 4);
    data += 4, size -= 4;
    if (len > size) len = static_cast<uint32_t>(size);
    const std::filesystem::path folder = dir / "cache";
    std::filesystem::remove_all(folder);
    std::filesystem::create_directories(folder);
    write_bytes((folder / "manifest-r0.json").string(), data, len);
    write_bytes((folder / "r0-000001.safetensors").string(), data + len, size - len);
    for (const char* writer : {"", "r0"}) {
      TensorCache c = TensorCache::open(folder.string(), "latents", writer);
      const std::vector<std::string> keys = c.keys();
      (void)c.verify(keys);
      for (const std::string& key : c.keys()) {
        for (const at::Tensor& t : c.read(key)) {
          if (!t.defined()) throw std::logic_error("read() returned an undefined tensor for " + key);
        }
      }
    }
    return;
  }
  if (!index) {
    const std::string path = (dir / "f.safetensors").string();
    write_bytes(path, data, size);
    const SafetensorsFile file = SafetensorsFile::open(path);
    uint64_t total = 0;
    for (const auto& t : file.tensors()) {
      const std::string_view raw = file.bytes(t);
      if (raw.size() != t.nbytes()) throw std::logic_error("bytes() size differs from nbytes()");
      if (t.nbytes() <= 4096) (void)file.get(t);
      total += t.nbytes();
    }
    if (total <= (uint64_t{1} << 16)) round_trip(file, (dir / "round.safetensors").string());
    return;
  }
  uint32_t len = 0;
  if (size < 4) return;
  std::memcpy(&len, data, 4);
  data += 4, size -= 4;
  if (len > size) len = static_cast<uint32_t>(size);
  const std::string index_path = (dir / "model.safetensors.index.json").string();
  write_bytes(index_path, data, len);
  write_bytes((dir / "s.safetensors").string(), data + len, size - len);
  const WeightFiles files = WeightFiles::open(index_path);
  for (const auto& name : files.names()) {
    const TensorInfo* t = files.find(name);
    if (!t) throw std::logic_error("names() lists a tensor find() does not know");
    if (t->nbytes() <= 4096) (void)files.get(name);
    (void)files.file_of(name);
  }
}

}  // namespace shoestring::fuzz
