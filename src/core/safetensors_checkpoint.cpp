// Checkpoint: a single .safetensors file or an HF checkpoint directory, seen
// as one map from key to tensor. Every key lives in exactly one file.
#include "safetensors_json.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace weightsync {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kIndexName = "model.safetensors.index.json";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(Errc::io, path.string(), ": cannot read");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(Errc::io, path.string(), ": read failed");
  return text.str();
}

struct Index {
  std::map<std::string, std::string> weight_map;  // key -> file name relative to the dir
  std::map<std::string, std::string> metadata;
};

Index read_index(const fs::path& index_path) {
  const std::string where = index_path.string();
  const json root = detail::parse_json_no_duplicates(read_text(index_path), where);
  if (!root.is_object())
    fail(Errc::format, where, ": must be a JSON object, got ", root.type_name());
  auto wm = root.find("weight_map");
  if (wm == root.end()) fail(Errc::format, where, ": missing \"weight_map\"");
  if (!wm->is_object())
    fail(Errc::format, where, ": \"weight_map\" must be an object {key: file}, got ",
         wm->type_name());
  Index index;
  for (const auto& [key, file] : wm->items()) {
    if (!file.is_string() || file.get_ref<const std::string&>().empty())
      fail(Errc::format, where, ": weight_map entry for key '", key, "' must be a file name, got ",
           file.dump());
    index.weight_map.emplace(key, file.get<std::string>());
  }
  if (auto meta = root.find("metadata"); meta != root.end()) {
    if (!meta->is_object())
      fail(Errc::format, where, ": \"metadata\" must be an object, got ", meta->type_name());
    for (const auto& [k, v] : meta->items())
      index.metadata.emplace(k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  return index;
}

// The only .safetensors file in `dir`; not_found if none, format if several
// (without an index there is no telling which keys come from where).
fs::path single_file_in(const fs::path& dir) {
  std::vector<fs::path> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().extension() == ".safetensors" && entry.is_regular_file())
      found.push_back(entry.path());
  if (ec) fail(Errc::io, dir.string(), ": cannot list directory: ", ec.message());
  if (found.empty())
    fail(Errc::not_found, dir.string(), ": no ", kIndexName, " and no .safetensors file");
  if (found.size() > 1) {
    std::sort(found.begin(), found.end());
    fail(Errc::format, dir.string(), ": ", found.size(), " .safetensors files (",
         found[0].filename().string(), ", ", found[1].filename().string(), ", ...) but no ",
         kIndexName, " to say which key lives where");
  }
  return found.front();
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ckpt;
  ckpt.path_ = path;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) fail(Errc::not_found, path, ": no such checkpoint file or directory");

  std::map<std::string, std::string> expected_file;  // key -> file, from the index
  std::vector<fs::path> files;
  bool from_index = false;
  if (!fs::is_directory(st)) {
    files.push_back(path);
  } else if (fs::exists(fs::path(path) / kIndexName)) {
    Index index = read_index(fs::path(path) / kIndexName);
    std::map<std::string, std::string> first_key_of;  // file name -> a key mapped to it
    for (const auto& [key, file] : index.weight_map) first_key_of.emplace(file, key);
    for (const auto& [name, key] : first_key_of) {
      const fs::path file = fs::path(path) / name;
      if (!fs::exists(file))
        fail(Errc::not_found, path, "/", kIndexName, ": names file '", name, "' (for key '", key,
             "') which does not exist");
      files.push_back(file);
    }
    from_index = true;
    expected_file = std::move(index.weight_map);
    ckpt.metadata_ = std::move(index.metadata);
  } else {
    files.push_back(single_file_in(path));
  }

  for (const fs::path& file : files) {
    const size_t slot = ckpt.files_.size();
    ckpt.files_.push_back(SafetensorsFile::open(file.string()));
    for (const TensorInfo& t : ckpt.files_.back()->tensors()) {
      auto [it, inserted] = ckpt.keys_.emplace(t.name, std::make_pair(slot, &t));
      if (!inserted)
        fail(Errc::format, path, ": key '", t.name,
             "' is in two files: ", ckpt.files_[it->second.first]->path(), " and ", file.string());
    }
  }
  for (const auto& [key, name] : expected_file) {
    auto it = ckpt.keys_.find(key);
    const std::string named = (fs::path(path) / name).string();
    if (it == ckpt.keys_.end())
      fail(Errc::format, path, "/", kIndexName, ": key '", key, "' is mapped to ", name,
           " but that file has no such tensor");
    if (ckpt.files_[it->second.first]->path() != named)
      fail(Errc::format, path, "/", kIndexName, ": key '", key, "' is mapped to ", name,
           " but lives in ", ckpt.files_[it->second.first]->path());
  }
  if (!from_index) ckpt.metadata_ = ckpt.files_.front()->metadata();
  return ckpt;
}

std::vector<std::string> Checkpoint::keys() const {
  std::vector<std::string> out;
  out.reserve(keys_.size());
  for (const auto& [key, where] : keys_) out.push_back(key);
  return out;
}

bool Checkpoint::contains(std::string_view key) const {
  return keys_.find(key) != keys_.end();
}

const TensorInfo& Checkpoint::info(std::string_view key) const {
  auto it = keys_.find(key);
  if (it == keys_.end()) fail(Errc::not_found, path_, ": no tensor '", key, "' in the checkpoint");
  return *it->second.second;
}

TensorView Checkpoint::view(std::string_view key) const {
  auto it = keys_.find(key);
  if (it == keys_.end()) fail(Errc::not_found, path_, ": no tensor '", key, "' in the checkpoint");
  return files_[it->second.first]->view(key);
}

}  // namespace weightsync
