#include "bench_overhead.h"

#include "cli.h"
#include "demo_run.h"

#include <weightsync/error.h>

#include <cstdio>
#include <vector>

namespace weightsync::cli {

nlohmann::json checksum_overhead(demo::JobSpec job, int rounds) {
  job.raw_rounds = 0;
  job.checksums_gpu = false;
  std::vector<double> off, on;
  // The slowest rank's pack and apply per step, where the sums are taken.
  std::vector<double> pack[2], apply[2];
  nlohmann::json per_round = nlohmann::json::array();
  for (int round = 0; round < 2 * rounds; ++round) {
    job.checksums = round % 2 == 1;
    const auto run = demo::run_job(job, "");
    const auto summary = demo::summarize(job, run);
    if (!summary["ok"].get<bool>())
      return {{"error", cat("the run with checksums ", job.checksums ? "on" : "off",
                            " failed: ", summary.value("error", std::string("see its summary")))}};
    std::vector<double> mine;
    for (const auto& row : summary["steps"])
      if (row["step"].get<int64_t>() > 1) {
        mine.push_back(row["sync_s"].get<double>());
        pack[job.checksums].push_back(row["phases"]["pack"].get<double>());
        apply[job.checksums].push_back(row["phases"]["apply"].get<double>());
      }
    (job.checksums ? on : off).insert((job.checksums ? on : off).end(), mine.begin(), mine.end());
    per_round.push_back({{"checksums", job.checksums}, {"sync_s_p50", percentile(mine, 0.5)}});
  }
  const double p50_off = percentile(off, 0.5), p50_on = percentile(on, 0.5);
  return {{"rounds", rounds},
          {"steps_each", off.size()},
          {"sync_s_p50_off", p50_off},
          {"sync_s_p50_on", p50_on},
          {"per_round", per_round},
          {"pack_s_p50_off", percentile(pack[0], 0.5)},
          {"pack_s_p50_on", percentile(pack[1], 0.5)},
          {"apply_s_p50_off", percentile(apply[0], 0.5)},
          {"apply_s_p50_on", percentile(apply[1], 0.5)},
          {"ratio", p50_off > 0 ? p50_on / p50_off : 0.0}};
}

void print_checksum_overhead(const nlohmann::json& m) {
  if (m.contains("error")) {
    std::printf("checksum overhead: %s\n", m["error"].get<std::string>().c_str());
    return;
  }
  std::printf(
      "checksum overhead: step p50 %.4f s with checksums off, %.4f s on -> ratio %.4f (on / off, "
      "%+.1f %%; %d rounds each way, alternating, %zu timed steps each way)\n",
      m["sync_s_p50_off"].get<double>(), m["sync_s_p50_on"].get<double>(), m["ratio"].get<double>(),
      (m["ratio"].get<double>() - 1) * 100, m["rounds"].get<int>(), m["steps_each"].get<size_t>());
  std::printf("  per round (p50 s):");
  for (const auto& r : m["per_round"])
    std::printf(" %s %.4f", r["checksums"].get<bool>() ? "on" : "off",
                r["sync_s_p50"].get<double>());
  std::printf(
      "\n  slowest rank's pack p50 %.1f ms off, %.1f ms on; apply p50 %.1f ms off, %.1f ms on\n",
      m["pack_s_p50_off"].get<double>() * 1e3, m["pack_s_p50_on"].get<double>() * 1e3,
      m["apply_s_p50_off"].get<double>() * 1e3, m["apply_s_p50_on"].get<double>() * 1e3);
}

}  // namespace weightsync::cli
