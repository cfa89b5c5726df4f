#include "core/json.h"

#include "core/check.h"

namespace flashlm {

nlohmann::json parse_untrusted_json(std::string_view text, std::string_view what, uint64_t max_bytes) {
  FLASHLM_CHECK(text.size() <= max_bytes, "{} has {} bytes, more than the {} this reads", what, text.size(), max_bytes);
  // The parser itself keeps its nesting on the heap; the callback sees the depth of every container as it
  // opens, so the document is refused at the first one too deep, before it is built.
  bool too_deep = false;
  const nlohmann::json::parser_callback_t limit = [&](int depth, nlohmann::json::parse_event_t event,
                                                      nlohmann::json&) {
    if ((event == nlohmann::json::parse_event_t::object_start || event == nlohmann::json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      too_deep = true;
      throw std::length_error("too deep");  // stops the parser; reported below
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text, limit);
  } catch (const nlohmann::json::parse_error& e) {
    // e.what() quotes the token it last read, which may be any length of the file.
    fail("{} is not valid JSON (a syntax error at byte {})", what, e.byte);
  } catch (const nlohmann::json::exception&) {
    fail("{} is not valid JSON", what);
  } catch (const std::length_error&) {
    if (!too_deep) throw;
    fail("{} is not valid here: its arrays and objects nest deeper than {} levels", what, kMaxJsonDepth);
  }
}

std::string json_excerpt(const nlohmann::json& value, size_t max_chars) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() <= max_chars) return text;
  // Cut at a character boundary, so that the message stays valid UTF-8.
  size_t cut = max_chars;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  text.resize(cut);
  return text + "...";
}

}  // namespace flashlm
