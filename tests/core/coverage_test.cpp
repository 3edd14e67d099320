// check_coverage on every tiny model under several parallel settings, checked
// again by per-element bitmaps, and on tampered layouts that it must reject.
#include "layouts/engine_test_util.h"

#include <gtest/gtest.h>

#include <map>

namespace weightsync {
namespace {

using testing::engine;
using testing::throws_errc;

struct Setting {
  int tp;
  bool ep;
  const char* placement;
  const char* framework;
};

const std::vector<std::string> kTinyModels{"tiny-llama",      "tiny-qwen2",     "tiny-qwen3",
                                           "tiny-qwen3-moe",  "tiny-qwen2-moe", "tiny-mixtral",
                                           "tiny-deepseek-v3"};

const std::vector<Setting> kSettings{
    {1, false, "linear", "vllm"},   {2, false, "linear", "vllm"},
    {4, false, "linear", "sglang"}, {2, true, "round_robin", "vllm"},
    {4, true, "linear", "vllm"},    {4, true, "round_robin", "sglang"}};

// Independent per-element check: every param element written at most once,
// unwritten elements only in tail rows; every HF element read by some rank.
void bitmap_check(const EngineLayout& layout, const std::string& what) {
  std::map<std::string, Shape> hf;
  for (const auto& t : hf_tensors(layout.config.hf)) hf.emplace(t.key, t.shape);
  std::map<std::string, std::vector<char>> hf_read;
  for (const auto& rank : layout.ranks) {
    for (const auto& p : rank.params) {
      std::vector<int> writes(static_cast<size_t>(numel(p.shape)), 0);
      const Shape ps = contiguous_strides(p.shape);
      for (const auto& s : p.segments) {
        const Shape& hs_shape = hf.at(s.hf_key);
        const Shape hs = contiguous_strides(hs_shape);
        auto& read = hf_read[s.hf_key];
        read.resize(static_cast<size_t>(numel(hs_shape)), 0);
        const size_t extra = s.param_box.rank() - s.hf_box.rank();
        for (int64_t i = 0; i < s.hf_box.numel(); ++i) {
          int64_t rem = i, src = 0, dst = 0;
          for (size_t d = s.hf_box.rank(); d-- > 0;) {
            const int64_t c = rem % s.hf_box.lengths[d];
            rem /= s.hf_box.lengths[d];
            src += (s.hf_box.offsets[d] + c) * hs[d];
            dst += (s.param_box.offsets[d + extra] + c) * ps[d + extra];
          }
          for (size_t d = 0; d < extra; ++d) dst += s.param_box.offsets[d] * ps[d];
          writes[static_cast<size_t>(dst)]++;
          read[static_cast<size_t>(src)] = 1;
        }
      }
      const int64_t row = p.shape.empty() ? 1 : numel(p.shape) / std::max<int64_t>(1, p.shape[0]);
      bool tail = false;
      for (size_t e = 0; e < writes.size(); ++e) {
        ASSERT_LE(writes[e], 1) << what << " " << p.name << " element " << e;
        if (e % static_cast<size_t>(row) == 0) tail = tail || writes[e] == 0;
        ASSERT_EQ(writes[e], tail ? 0 : 1) << what << " " << p.name << " element " << e;
      }
    }
  }
  for (const auto& [key, shape] : hf) {
    ASSERT_TRUE(hf_read.count(key)) << what << ": no rank reads " << key;
    for (char c : hf_read[key]) ASSERT_EQ(c, 1) << what << ": part of " << key << " unread";
  }
}

TEST(Coverage, EveryTinyModelUnderEverySetting) {
  int checked = 0;
  for (const auto& m : kTinyModels) {
    for (const auto& s : kSettings) {
      auto c = engine(m, s.tp, s.ep, s.placement, s.framework);
      const std::string what = m + " tp=" + std::to_string(s.tp) + (s.ep ? " ep " : " ") +
                               s.placement + " " + s.framework;
      EngineLayout layout;
      try {
        layout = make_engine_layout(c);
      } catch (const Error& e) {
        // tiny-qwen2 has 2 KV heads, 4 heads: tp=4 is valid; nothing here may fail.
        FAIL() << what << ": " << e.what();
      }
      EXPECT_NO_THROW(check_coverage(layout)) << what;
      bitmap_check(layout, what);
      ++checked;
    }
  }
  EXPECT_EQ(checked, static_cast<int>(kTinyModels.size() * kSettings.size()));
}

TEST(Coverage, RealModelLayoutsPass) {
  for (const auto& [m, tp, ep] :
       std::vector<std::tuple<std::string, int, bool>>{{"Llama-3-8B", 8, false},
                                                       {"Qwen3-30B-A3B", 4, true},
                                                       {"Mixtral-8x7B", 2, false},
                                                       {"DeepSeek-V3", 8, true},
                                                       {"Kimi-K2", 16, true}}) {
    const auto layout = make_engine_layout(engine(m, tp, ep));
    EXPECT_NO_THROW(check_coverage(layout)) << m;
  }
}

TEST(Coverage, RejectsOverlapsHolesAndOutOfBounds) {
  const auto good = make_engine_layout(engine("tiny-llama", 2));
  auto find = [](EngineLayout& l, int r, const std::string& n) -> EngineParam& {
    for (auto& p : l.ranks[static_cast<size_t>(r)].params)
      if (p.name == n) return p;
    throw Error(Errc::not_found, n);
  };
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.weight";
  auto overlap = good;
  find(overlap, 0, qkv).segments[1].param_box.offsets[0] = 0;  // k onto q's rows
  EXPECT_TRUE(throws_errc([&] { check_coverage(overlap); }, Errc::invalid_layout, "both write"));
  auto hole = good;
  find(hole, 1, qkv).segments.erase(find(hole, 1, qkv).segments.begin() + 1);
  EXPECT_TRUE(throws_errc([&] { check_coverage(hole); }, Errc::invalid_layout, qkv));
  auto outside = good;
  find(outside, 0, qkv).segments[0].hf_box.offsets[0] = 60;
  EXPECT_TRUE(throws_errc([&] { check_coverage(outside); }, Errc::invalid_layout, "outside"));
  auto unknown = good;
  find(unknown, 0, qkv).segments[0].hf_key = "model.layers.9.self_attn.q_proj.weight";
  EXPECT_TRUE(throws_errc([&] { check_coverage(unknown); }, Errc::invalid_layout, "layers.9"));
  auto size = good;
  find(size, 0, qkv).segments[0].param_box.lengths[0] = 8;
  EXPECT_TRUE(throws_errc([&] { check_coverage(size); }, Errc::invalid_layout, "differ in size"));
  // Both ranks read rank 0's rows of down_proj: each param is fine, but the
  // replica never reads rank 1's half of the HF tensor.
  auto unread = good;
  const std::string down = "model.layers.1.mlp.down_proj.weight";
  find(unread, 1, down).segments[0].hf_box.offsets[1] = 0;
  EXPECT_TRUE(throws_errc([&] { check_coverage(unread); }, Errc::invalid_layout, down));
}

}  // namespace
}  // namespace weightsync
