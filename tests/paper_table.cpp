// tests/paper_table.cpp — the paper's Table 1 (model-state memory per device,
// K = 12 mixed precision) for the 7.5B-parameter model, recomputed with
// z2::model_states_formula: the function the engine's ledger and the
// trainer's fit check use, so the table and the measured ledgers cannot
// disagree by construction. Beside each value: what the paper prints
// (Rajbhandari et al., SC20, Table 1, GB = 10^9 bytes), and whether ours
// rounds to the same digits. Stage 3 (P_os+g+p, 16 Psi / N) is the paper's
// formula only: zero2 does not partition parameters.
//   build/paper_table      (make notes pastes its output into notes/08)
#include <cmath>
#include <cstdio>
#include <string>

#include "../zero2.h"

int main() {
  const double psi = 7.5e9, gigabyte = 1e9;
  const int ranks[] = {1, 4, 16, 64, 256, 1024};
  // Table 1's 7.5B rows: P_os, P_os+g, P_os+g+p (the baseline is 120 GB for every N).
  const char* printed[3][6] = {{"120", "52.5", "35.6", "31.4", "30.4", "30.1"},
                               {"120", "41.3", "21.6", "16.6", "15.4", "15.1"},
                               {"120", "30", "7.5", "1.88", "0.47", "0.12"}};
  printf("| N | DP (stage 0) | P_os (stage 1) | paper | P_os+g (stage 2) | paper | P_os+g+p (formula only) | paper |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  bool all_equal = true;
  for (int k = 0; k < 6; ++k) {
    const double N = ranks[k];
    double values[3] = {z2::model_states_formula(1, z2::Precision::bf16, psi, N) / gigabyte,
                        z2::model_states_formula(2, z2::Precision::bf16, psi, N) / gigabyte,
                        16 * psi / N / gigabyte};  // P_p: the formula only, zero2 has no stage 3
    std::string cells[3];
    for (int s = 0; s < 3; ++s) {
      // The paper's digits: as many decimals as it printed, halves rounded
      // up as a table does (41.25 prints 41.3; printf would round to even).
      const std::string paper = printed[s][k];
      const size_t dot = paper.find('.');
      const int decimals = dot == std::string::npos ? 0 : (int)(paper.size() - dot - 1);
      const double unit = std::pow(10.0, decimals);
      char mine[32];
      snprintf(mine, sizeof mine, "%.*f", decimals, std::floor(values[s] * unit + 0.5) / unit);
      const bool equal = paper == mine;
      all_equal &= equal;
      char cell[64];
      snprintf(cell, sizeof cell, "%.2f GB | %s%s", values[s], paper.c_str(), equal ? "" : " (DIFFERS)");
      cells[s] = cell;
    }
    printf("| %d | %.0f GB | %s | %s | %s |\n", ranks[k],
           z2::model_states_formula(0, z2::Precision::bf16, psi, N) / gigabyte, cells[0].c_str(), cells[1].c_str(),
           cells[2].c_str());
  }
  printf("\n%s\n", all_equal ? "Every value rounds to the digits the paper prints."
                             : "Some values do NOT round to the paper's digits (marked DIFFERS).");
  return all_equal ? 0 : 1;
}
