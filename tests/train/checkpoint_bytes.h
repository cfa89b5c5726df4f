// A checkpoint file taken apart and put back together as docs/design.md describes format 2, written here
// independently of src/train/checkpoint.cpp, so that tests can make files a buggy or hostile writer
// would make: wrong fields with valid checksums, flipped bits, other sizes.
#pragma once
#include <zlib.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

namespace flashlm::test {

struct CheckpointBytes {
  std::string magic;     // 8 bytes
  nlohmann::json header;
  std::string payload;   // parameters, m, v

  static CheckpointBytes read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CheckpointBytes c;
    c.magic = bytes.substr(0, 8);
    uint64_t len = 0;
    std::memcpy(&len, bytes.data() + 8, sizeof len);
    c.header = nlohmann::json::parse(bytes.substr(20, len));
    c.payload = bytes.substr(20 + len);
    return c;
  }

  static uint32_t crc(uint32_t crc, const std::string& bytes) {
    return static_cast<uint32_t>(crc32_z(crc, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
  }

  // The file's bytes, with the header's checksum made to fit (and the payload's too, unless told not to).
  std::string bytes(bool fix_payload_crc = true) const {
    nlohmann::json h = header;
    if (fix_payload_crc) h["payload_crc32"] = crc(0, payload);
    const std::string text = h.dump();
    std::string prelude = magic;
    const uint64_t len = text.size();
    prelude.append(reinterpret_cast<const char*>(&len), sizeof len);
    const uint32_t header_crc = crc(crc(0, prelude), text);
    prelude.append(reinterpret_cast<const char*>(&header_crc), sizeof header_crc);
    return prelude + text + payload;
  }

  void write(const std::string& path, bool fix_payload_crc = true) const {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const std::string b = bytes(fix_payload_crc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  }
};

}  // namespace flashlm::test
