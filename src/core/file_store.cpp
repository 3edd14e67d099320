#include <weightsync/error.h>
#include <weightsync/store.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <unistd.h>

namespace weightsync {
namespace {

class FileStore final : public Store {
 public:
  explicit FileStore(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) fail(Errc::io, "file store: cannot create ", dir_.string(), ": ", ec.message());
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    const auto final_path = path_of(key);
    const auto tmp = final_path.string() + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(value.data()),
                static_cast<std::streamsize>(value.size()));
      if (!out) fail(Errc::io, "file store: cannot write key '", key, "' to ", tmp);
    }
    std::error_code ec;
    std::filesystem::rename(tmp, final_path, ec);
    if (ec) fail(Errc::io, "file store: cannot publish key '", key, "': ", ec.message());
  }

  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const auto p = path_of(key);
    auto pause = std::chrono::microseconds(100);
    while (true) {
      std::ifstream in(p, std::ios::binary);
      if (in) return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
      if (std::chrono::steady_clock::now() >= deadline)
        fail(Errc::timeout, "file store ", dir_.string(), ": key '", key, "' not set within ",
             timeout.count(), " ms");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(20000));
    }
  }

 private:
  std::filesystem::path path_of(const std::string& key) const {
    std::string safe;
    for (char c : key)
      safe += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.') ? c : '_';
    return dir_ / (safe + "." + std::to_string(std::hash<std::string>{}(key)));
  }
  std::filesystem::path dir_;
};

}  // namespace

std::unique_ptr<Store> make_file_store(const std::string& directory) {
  return std::make_unique<FileStore>(directory);
}
}  // namespace weightsync
