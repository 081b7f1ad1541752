/*
 * tile_plan_cli — print or check the shared attention tile plan on any machine (plain C++).
 *
 *   tile_plan_cli plan --heads 32 --kv-heads 8 --head-dim 128 --kv-tile 64 --lens 1,100,513
 *       prints the training plan's tasks as JSON lines
 *   tile_plan_cli check
 *       sweeps shapes and asserts that training, chunked-prefill (paged) and decode (paged) views
 *       give every token the same tile plan; exit 0 when they do (run by CTest)
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "tile_plan.h"

using namespace onpolicy::tp;

namespace {

std::vector<int32_t> ParseList(const char *s)
{
    std::vector<int32_t> out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        out.push_back(std::atoi(item.c_str()));
    }
    return out;
}

/* The arithmetic-relevant projection of a token plan with logical tile starts. */
std::string Canonical(const TokenPlan &t, const std::vector<int64_t> &logical)
{
    std::ostringstream o;
    o << t.block_rows << '/' << t.kv_tile << '/' << t.head_dim << '/' << t.kv_split << '/' << t.position << '/'
      << t.tiles_effective << ':';
    for (int32_t j = 0; j < t.tiles_visited; ++j) {
        if (j < t.tiles_effective) {
            o << logical[static_cast<size_t>(j)] << '+' << t.tile_cols[static_cast<size_t>(j)] << ',';
        } else if (t.tile_cols[static_cast<size_t>(j)] != 0) {
            o << "!noop-tile-has-columns";
        }
    }
    return o.str();
}

int Check()
{
    int failures = 0, checked = 0;
    for (int32_t kv_tile : {16, 64, 128}) {
        for (int32_t group : {1, 2, 4, 8}) {
            for (int32_t rtpb : {1, 4}) {
                AttnConsts c;
                c.num_kv_heads = 2;
                c.num_heads = 2 * group;
                c.head_dim = 64;
                c.kv_tile = kv_tile;
                c.row_tile = 8;
                c.row_tiles_per_block = rtpb;
                const std::vector<int32_t> lens = {1, kv_tile - 1, kv_tile, kv_tile + 1, 2 * kv_tile + 3, 5};
                std::vector<int64_t> cu = {0};
                for (int32_t n : lens) {
                    cu.push_back(cu.back() + n);
                }
                const AttentionPlan train = BuildAttentionPlan(c, kKvContiguous, 0, TrainingSeqs(cu), 48);
                // paged cache: page = 2 tiles, pages of sequence s are s*max_pages + p (identity-like)
                const int32_t page = 2 * kv_tile;
                int32_t max_pages = 0;
                for (int32_t n : lens) {
                    max_pages = std::max(max_pages, (n + page - 1) / page);
                }
                std::vector<int32_t> table;
                for (size_t s = 0; s < lens.size(); ++s) {
                    for (int32_t p = 0; p < max_pages; ++p) {
                        table.push_back(static_cast<int32_t>((lens.size() - s) * max_pages + p));  // shuffled order
                    }
                }
                for (size_t s = 0; s < lens.size(); ++s) {
                    for (int32_t pos = 0; pos < lens[s]; ++pos) {
                        const std::vector<int32_t> one_table(table.begin() + static_cast<long>(s) * max_pages,
                                                             table.begin() + static_cast<long>(s + 1) * max_pages);
                        const AttentionPlan decode =
                            BuildAttentionPlan(c, kKvPaged, page, PagedSeqs({1}, {pos}, {pos + 1}, one_table, max_pages),
                                               7);
                        for (int32_t h = 0; h < c.num_heads; ++h) {
                            const TokenPlan tt = TokenOf(train, static_cast<int32_t>(s), pos, h);
                            const TokenPlan td = TokenOf(decode, 0, 0, h);
                            std::vector<int64_t> lt, ld;
                            for (int64_t row : tt.tile_kv_row) {
                                lt.push_back(row - cu[s]);
                            }
                            for (int64_t row : td.tile_kv_row) {
                                const int64_t pg = row / page;
                                int64_t idx = 0;
                                while (one_table[static_cast<size_t>(idx)] != pg) {
                                    ++idx;
                                }
                                ld.push_back(idx * page + row % page);
                            }
                            ++checked;
                            if (Canonical(tt, lt) != Canonical(td, ld)) {
                                ++failures;
                                std::fprintf(stderr, "mismatch kv_tile=%d group=%d seq=%zu pos=%d head=%d\n", kv_tile,
                                             group, s, pos, h);
                            }
                        }
                    }
                }
            }
        }
    }
    std::printf("{\"checked\": %d, \"failures\": %d}\n", checked, failures);
    return failures == 0 ? 0 : 1;
}

int Plan(int argc, char **argv)
{
    AttnConsts c;
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 128;
    std::vector<int32_t> lens = {1, 100};
    for (int i = 2; i + 1 < argc; i += 2) {
        const std::string k = argv[i];
        if (k == "--heads") {
            c.num_heads = std::atoi(argv[i + 1]);
        } else if (k == "--kv-heads") {
            c.num_kv_heads = std::atoi(argv[i + 1]);
        } else if (k == "--head-dim") {
            c.head_dim = std::atoi(argv[i + 1]);
        } else if (k == "--kv-tile") {
            c.kv_tile = std::atoi(argv[i + 1]);
        } else if (k == "--row-tile") {
            c.row_tile = std::atoi(argv[i + 1]);
        } else if (k == "--lens") {
            lens = ParseList(argv[i + 1]);
        } else {
            std::fprintf(stderr, "unknown option %s\n", k.c_str());
            return 2;
        }
    }
    std::vector<int64_t> cu = {0};
    for (int32_t n : lens) {
        cu.push_back(cu.back() + n);
    }
    try {
        const AttentionPlan plan = BuildAttentionPlan(c, kKvContiguous, 0, TrainingSeqs(cu), 48);
        const AttnGeometry &g = plan.geometry;
        std::printf("{\"tasks\": %lld, \"kv_tasks\": %lld, \"workers\": %d, \"block_rows\": %d, \"kv_tile\": %d}\n",
                    static_cast<long long>(g.num_tasks), static_cast<long long>(g.num_kv_tasks), g.workers,
                    g.block_rows, g.kv_tile);
        for (const Task &t : plan.tasks) {
            std::printf("{\"seq\": %d, \"kv_head\": %d, \"block\": %d, \"rows\": [%d, %d], \"positions\": [%d, %d], "
                        "\"kv_tiles\": %d}\n",
                        t.seq, t.kv_head, t.block, t.first_row, t.first_row + t.valid_rows, t.first_pos, t.last_pos,
                        t.num_kv_tiles);
        }
    } catch (const std::exception &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}

}  // namespace

int main(int argc, char **argv)
{
    if (argc >= 2 && std::strcmp(argv[1], "check") == 0) {
        return Check();
    }
    if (argc >= 2 && std::strcmp(argv[1], "plan") == 0) {
        return Plan(argc, argv);
    }
    std::fprintf(stderr, "usage: tile_plan_cli check | plan [--heads H --kv-heads K --head-dim D --kv-tile T "
                         "--row-tile R --lens a,b,c]\n");
    return 2;
}
