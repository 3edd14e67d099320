// `weightsync inspect F [--json]`: what a checkpoint holds, read from the
// headers only (no tensor bytes are touched).
#include "cli.h"

#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync inspect PATH [--json]\n\n"
    "Lists the tensors of a checkpoint: a .safetensors file, or an HF directory with\n"
    "model.safetensors.index.json (or a single .safetensors file). Reads the headers only.\n\n"
    "  PATH     the file or directory\n"
    "  --json   print one JSON object: {\"path\", \"tensors\": [{\"name\", \"dtype\", \"shape\",\n"
    "           \"bytes\"}], \"total_bytes\", \"metadata\", \"files\"}\n"
    "  --help   this text\n";

uint64_t tensor_bytes(const TensorInfo& t) {
  return t.end - t.begin;
}

std::string human_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", v, units[u]);
  return buf;
}

void print_json(const Checkpoint& ckpt) {
  nlohmann::json tensors = nlohmann::json::array();
  uint64_t total = 0;
  for (const auto& key : ckpt.keys()) {
    const TensorInfo& t = ckpt.info(key);
    tensors.push_back({{"name", key},
                       {"dtype", dtype_name(t.dtype)},
                       {"shape", t.shape},
                       {"bytes", tensor_bytes(t)}});
    total += tensor_bytes(t);
  }
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : ckpt.files()) files.push_back(f->path());
  nlohmann::json out = {{"path", ckpt.path()},
                        {"tensors", std::move(tensors)},
                        {"total_bytes", total},
                        {"metadata", ckpt.metadata()},
                        {"files", std::move(files)}};
  std::cout << out.dump(2) << "\n";
}

void print_table(const Checkpoint& ckpt) {
  const auto keys = ckpt.keys();
  size_t name_width = 4;
  for (const auto& k : keys) name_width = std::max(name_width, k.size());
  std::cout << ckpt.path() << ": " << keys.size() << " tensors in " << ckpt.files().size()
            << (ckpt.files().size() == 1 ? " file\n\n" : " files\n\n");
  std::printf("%-*s  %-8s  %-24s  %14s\n", int(name_width), "name", "dtype", "shape", "bytes");
  uint64_t total = 0;
  for (const auto& key : keys) {
    const TensorInfo& t = ckpt.info(key);
    const std::string dtype(dtype_name(t.dtype));
    std::printf("%-*s  %-8s  %-24s  %14llu\n", int(name_width), key.c_str(), dtype.c_str(),
                shape_str(t.shape).c_str(), static_cast<unsigned long long>(tensor_bytes(t)));
    total += tensor_bytes(t);
  }
  std::printf("\ntotal: %zu tensors, %llu bytes (%s)\n", keys.size(),
              static_cast<unsigned long long>(total), human_bytes(total).c_str());
  if (!ckpt.metadata().empty()) {
    std::cout << "metadata:\n";
    for (const auto& [k, v] : ckpt.metadata()) std::cout << "  " << k << ": " << v << "\n";
  }
}

int run_inspect(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {});
  if (args.positional().size() != 1)
    fail(Errc::invalid_argument, "expected one checkpoint PATH, got ", args.positional().size(),
         " (see weightsync inspect --help)");
  const Checkpoint ckpt = Checkpoint::open(args.positional()[0]);
  if (args.flag("json"))
    print_json(ckpt);
  else
    print_table(ckpt);
  return 0;
}

const CommandRegistrar registrar{
    {"inspect", "list the tensors (dtype, shape, bytes) of a checkpoint", kUsage, run_inspect}};

}  // namespace
}  // namespace weightsync::cli
