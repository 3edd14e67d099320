// The registry of engine frameworks: adding one is its file and a line here.
#include "engine_framework.h"

#include <weightsync/error.h>

#include <array>

namespace weightsync::engine {

extern const Framework kVllm;     // framework_vllm.cpp
extern const Framework kSglang;   // framework_sglang.cpp
extern const Framework kHf;       // framework_hf.cpp
extern const Framework kDerived;  // framework_derived.cpp

namespace {

const std::array<const Framework*, 4> kRegistry{&kVllm, &kSglang, &kHf, &kDerived};

}  // namespace

const Framework& find_framework(std::string_view name) {
  for (const Framework* f : kRegistry)
    if (f->name == name) return *f;
  std::string known;
  for (size_t i = 0; i < kRegistry.size(); ++i)
    known += cat(i == 0                      ? ""
                 : i + 1 == kRegistry.size() ? " or "
                                             : ", ",
                 "\"", kRegistry[i]->name, "\"");
  fail(Errc::invalid_layout, "engine config: framework '", name, "' is not supported (expected ",
       known, ")");
}

void check_framework_options(const Framework& f, const EngineConfig& c) {
  if (c.tp < 1 || c.replicas < 1)
    fail(Errc::invalid_layout, "engine config: tp (", c.tp, ") and replicas (", c.replicas,
         ") must be positive");
  if (c.moe_order != "w13" && c.moe_order != "w31")
    fail(Errc::invalid_layout, "engine config: moe_order '", c.moe_order,
         "' is not supported (expected \"w13\" or \"w31\")");
  if (c.moe_order == "w31" && !f.takes_w31)
    fail(Errc::invalid_layout, "engine config: moe_order \"w31\" is an SGLang option; ", f.name,
         " stores w13 (gate first)");
}

}  // namespace weightsync::engine
