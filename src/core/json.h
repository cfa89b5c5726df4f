// Parsing JSON that comes from outside (a file a user gives): nlohmann's serializer and copies recurse once
// per level of nesting, so a few hundred KB of '[' overflow the stack of whatever dumps or copies the value.
// Every reader of such JSON parses through here, which refuses a document nested deeper than any file flashlm
// or the formats it reads ever write, before a value that deep exists.
#pragma once
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace flashlm {

// Deeper than a tokenizer.json (the deepest JSON flashlm reads, about 5 levels), far shallower than a stack.
inline constexpr int kMaxJsonDepth = 64;

// Parses `text`: more than max_bytes, nesting deeper than kMaxJsonDepth and invalid JSON are each a
// flashlm::Error whose message starts with `what` ("tokenizer: 'x.json'") and quotes none of the text.
nlohmann::json parse_untrusted_json(std::string_view text, std::string_view what, uint64_t max_bytes);

// A value for an error message: its JSON text, invalid UTF-8 replaced, cut to about max_chars with "...".
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 80);

}  // namespace flashlm
