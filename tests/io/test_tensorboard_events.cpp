// TensorBoard event files (io/tensorboard_events.h): CRC-32C against RFC
// 3720's test vectors (appendix B.4), the TFRecord framing byte by byte,
// and each Event read back by a protobuf wire-format decoder written here
// against event.proto / summary.proto's field numbers (tensorboard/compat/proto).
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "shoestring/core/error.h"
#include "shoestring/io/tensorboard_events.h"

namespace fs = std::filesystem;
using namespace shoestring;

namespace {

/// One decoded protobuf field: varint / fixed64 / fixed32 as their bits,
/// length-delimited as bytes.
struct Field {
  int wire = 0;
  uint64_t number = 0;
  std::string bytes;
};

/// field number -> its occurrences, in order. Fails the test on malformed input.
std::multimap<int, Field> decode(const std::string& msg) {
  std::multimap<int, Field> out;
  size_t i = 0;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0; i < msg.size(); shift += 7) {
      const auto b = static_cast<unsigned char>(msg[i++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    ADD_FAILURE() << "varint cut short";
    return v;
  };
  while (i < msg.size()) {
    const uint64_t key = varint();
    Field f;
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.number = varint();
    } else if (f.wire == 1 || f.wire == 5) {
      const size_t n = f.wire == 1 ? 8 : 4;
      EXPECT_LE(i + n, msg.size());
      std::memcpy(&f.number, msg.data() + i, n);
      i += n;
    } else if (f.wire == 2) {
      const uint64_t n = varint();
      EXPECT_LE(i + n, msg.size());
      f.bytes = msg.substr(i, n);
      i += n;
    } else {
      ADD_FAILURE() << "wire type " << f.wire;
      break;
    }
    out.emplace(static_cast<int>(key >> 3), f);
  }
  return out;
}

double as_double(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

float as_float(uint64_t bits) {
  const auto b = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace

TEST(TensorBoardEvents, Crc32cMatchesRfc3720Vectors) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending += static_cast<char>(i);
    descending += static_cast<char>(31 - i);
  }
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
  EXPECT_EQ(crc32c(""), 0u);
  const uint32_t c = crc32c("abc");
  EXPECT_EQ(masked_crc32c("abc"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoardEvents, TfrecordFramesLengthDataAndTheirChecksums) {
  const std::string data = "hello event";
  const std::string r = tfrecord(data);
  ASSERT_EQ(r.size(), data.size() + 16);
  uint64_t length = 0;
  uint32_t length_crc = 0, data_crc = 0;
  std::memcpy(&length, r.data(), 8);
  std::memcpy(&length_crc, r.data() + 8, 4);
  std::memcpy(&data_crc, r.data() + 12 + data.size(), 4);
  EXPECT_EQ(length, data.size());
  EXPECT_EQ(std::string(r.data(), 8), std::string("\x0b\0\0\0\0\0\0\0", 8));  // little-endian
  EXPECT_EQ(length_crc, masked_crc32c(std::string_view(r.data(), 8)));
  EXPECT_EQ(r.substr(12, data.size()), data);
  EXPECT_EQ(data_crc, masked_crc32c(data));
}

TEST(TensorBoardEvents, EventsDecodeAsEventProtos) {
  // file_version: Event{wall_time = 1, file_version = 3}
  auto fv = decode(event_file_version(1234.5));
  ASSERT_EQ(fv.count(1), 1u);
  EXPECT_EQ(fv.find(1)->second.wire, 1);
  EXPECT_DOUBLE_EQ(as_double(fv.find(1)->second.number), 1234.5);
  ASSERT_EQ(fv.count(3), 1u);
  EXPECT_EQ(fv.find(3)->second.bytes, "brain.Event:2");
  EXPECT_EQ(fv.count(2), 0u);  // step 0: proto3 leaves it out

  // scalars: Event{step = 2, summary = 5{value = 1{tag = 1, simple_value = 2}}}
  auto ev = decode(event_scalars(99.0, 300, {{"train/loss", 0.25f}, {"memory/peak_MiB", 1536.0f}}));
  ASSERT_EQ(ev.count(2), 1u);
  EXPECT_EQ(ev.find(2)->second.wire, 0);
  EXPECT_EQ(ev.find(2)->second.number, 300u);
  ASSERT_EQ(ev.count(5), 1u);
  auto summary = decode(ev.find(5)->second.bytes);
  ASSERT_EQ(summary.count(1), 2u);
  std::vector<std::pair<std::string, float>> values;
  for (auto it = summary.lower_bound(1); it != summary.upper_bound(1); ++it) {
    auto value = decode(it->second.bytes);
    ASSERT_EQ(value.count(1), 1u);
    ASSERT_EQ(value.count(2), 1u);
    EXPECT_EQ(value.find(2)->second.wire, 5);
    values.emplace_back(value.find(1)->second.bytes, as_float(value.find(2)->second.number));
  }
  EXPECT_EQ(values, (std::vector<std::pair<std::string, float>>{{"train/loss", 0.25f}, {"memory/peak_MiB", 1536.0f}}));

  // session start: Event{step, session_log = 7{status = 1: START}}
  auto start = decode(event_session_start(5.0, 41));
  EXPECT_EQ(start.find(2)->second.number, 41u);
  ASSERT_EQ(start.count(7), 1u);
  auto log = decode(start.find(7)->second.bytes);
  ASSERT_EQ(log.count(1), 1u);
  EXPECT_EQ(log.find(1)->second.number, 1u);
}

TEST(TensorBoardEvents, WriterAppendsCheckedRecordsToANewFile) {
  const fs::path dir = fs::temp_directory_path() / ("shoestring_tfevents_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string path;
  {
    EventFileWriter w((dir / "logs").string());
    path = w.path();
    w.write(event_scalars(wall_time_now(), 1, {{"a", 1.0f}}));
    w.write(event_scalars(wall_time_now(), 2, {{"a", 2.0f}}));
    // Flushed after each event: readable while the writer is open.
    EXPECT_EQ(read_tfrecords(path).size(), 3u);
  }
  EXPECT_EQ(fs::path(path).parent_path(), dir / "logs");
  EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
  const auto records = read_tfrecords(path);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(decode(records[0]).find(3)->second.bytes, "brain.Event:2");
  EXPECT_EQ(decode(records[2]).find(2)->second.number, 2u);
  // A flipped data byte, a cut file: named errors.
  std::ostringstream contents;
  contents << std::ifstream(path, std::ios::binary).rdbuf();
  const std::string bytes = contents.str();
  std::string bad = bytes;
  bad[14] ^= 1;
  std::ofstream(dir / "bad", std::ios::binary) << bad;
  EXPECT_THROW(read_tfrecords((dir / "bad").string()), Error);
  std::ofstream(dir / "cut", std::ios::binary) << bytes.substr(0, bytes.size() - 2);
  try {
    read_tfrecords((dir / "cut").string());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cut short"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
