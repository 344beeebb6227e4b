/**
 * @file schedule/kernel.cu
 * @brief The work schedule of a persistent decode, computed on the device from the device's
 * sequence lengths (so a captured graph needs no host synchronization): the same integers as
 * `plan::schedule::Schedule::build` in the host code, which is its reference (docs/scheduler.md).
 *
 * Jobs: job j = (request * token_blocks + token_block) * head_blocks + head_block, over the
 * union of its tokens' keys (common/rows.cuh), in blocks of 64 keys at multiples of 64. Laid
 * end to end on a cost line (segment_cost, then one unit a block), CTA c takes the stretch
 * [c share, (c + 1) share), share = max(aligned(ceil(total / ctas), the longest job's cost),
 * segment_cost + min_blocks, 1) (aligned_share below).
 *
 * One CTA of THREADS threads; no step is a serial loop over the jobs: each thread costs its
 * jobs, a block-wide scan (warp shuffles, two barriers) gives the cost line, each thread finds
 * its CTAs' start cursors by binary search over the line, then its jobs' first and last CTAs
 * by binary search over the cursors, and a second scan the jobs' first workspace slots; all
 * in shared memory for up to SMEM_JOBS jobs, written out as each is final.
 */
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "params.cuh"

namespace {

constexpr int THREADS = 1024;
constexpr int BLOCK = SCHEDULE_BLOCK;
// The cost line, the cursors and the slots live in shared memory when they fit (a binary
// search is a chain of dependent reads) and go out to global memory once computed. Keeping
// the scans there too, rather than scanning in global memory and copying the line in, did
// not change the kernel's 5.5 to 6.5 us (Nsight Compute, H200, 2026-12-03, ece2f1c): what it
// spends is not those round trips.
constexpr int SMEM_JOBS = 4096;  // ints of the cost line (jobs + 1) and of the slots (jobs)
constexpr int SMEM_BEGIN = 2 * 1025;  // ints of the cursors (2 x (CTAs + 1))

/// Exclusive prefix sum of a[0 .. n) in place, by the whole CTA (each thread a contiguous
/// chunk; the chunks' sums scanned by warp shuffles, then the 32 warps' totals by warp 0, so
/// two barriers instead of two per doubling step); returns the total to every thread.
/// `sums`: 32 ints of shared memory.
__device__ int block_scan(int* a, int n, int* sums) {
    static_assert(THREADS == 32 * 32, "warp 0 scans one total per warp");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int per = (n + THREADS - 1) / THREADS;
    const int lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += a[i];
    int x = sum;  // inclusive scan of the chunk sums within the warp
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int t = sums[lane];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, t, d);
            if (lane >= d) t += y;
        }
        sums[lane] = t;  // inclusive: warps 0 .. lane
    }
    __syncthreads();
    int run = (warp > 0 ? sums[warp - 1] : 0) + x - sum;
    const int total = sums[31];
    for (int i = lo; i < hi; ++i) {
        const int v = a[i];
        a[i] = run;
        run += v;
    }
    __syncthreads();  // a is scanned, and sums is free for the next scan
    return total;
}

/// plan::schedule::aligned_share: the even share, or, where one is at most 1 /
/// SCHEDULE_ALIGN_SLACK longer, a whole number of the longest job's cost or a whole fraction
/// of it (equal lengths then line up with the stretches).
__device__ __forceinline__ int aligned_share(int even, int longest) {
    if (longest == 0 || even == 0) return even;
    const int candidate =
        longest >= even ? (longest + longest / even - 1) / (longest / even) : longest * ((even + longest - 1) / longest);
    const bool near = (long long)candidate * SCHEDULE_ALIGN_SLACK <= (long long)even * (SCHEDULE_ALIGN_SLACK + 1);
    return near ? candidate : even;
}

/// Lexicographic order of (job, block) cursors.
__device__ __forceinline__ bool at_most(int job_a, int block_a, int job_b, int block_b) {
    return job_a < job_b || (job_a == job_b && block_a <= block_b);
}

/// The CTA whose range holds (job, block): how many of CTAs 1 .. ctas start at or before it
/// (`begin`: the cursors, in shared or global memory).
__device__ int cta_of(const int* begin, int ctas, int job, int block) {
    int lo = 1, hi = ctas + 1;  // first c in [1, ctas] with begin[c] > (job, block)
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (at_most(begin[2 * mid], begin[2 * mid + 1], job, block)) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo - 1;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) mla_schedule(const ScheduleParams sp) {
    allow_dependent_launch();  // the scheduled decode may start launching (it waits for us)
    __shared__ int sums[32];
    __shared__ int line_s[SMEM_JOBS];
    __shared__ int begin_s[SMEM_BEGIN];
    __shared__ int slot_s[SMEM_JOBS];
    __shared__ int longest;  // the costliest job's cost
    const DecodeParams& p = sp.d;
    const int jobs = sp.jobs, seg = sp.segment_cost;
    const int pack = p.tokens_per_cta;
    const int token_blocks = (p.query_len + pack - 1) / pack;

    const bool line_fits = jobs + 1 <= SMEM_JOBS, begin_fits = 2 * (sp.ctas + 1) <= SMEM_BEGIN;
    int* line = line_fits ? line_s : sp.line;
    int* begin = begin_fits ? begin_s : sp.begin;
    int* slots = line_fits ? slot_s : sp.first_slot;

    // 1. Each job's cost: its blocks and one segment cost; the costliest.
    if (threadIdx.x == 0) longest = 0;
    __syncthreads();
    int my_longest = 0;
    for (int j = threadIdx.x; j < jobs; j += THREADS) {
        const int req = j / (token_blocks * sp.head_blocks);
        const int tok0 = (j / sp.head_blocks) % token_blocks * pack;
        const int len = request_len(p, req, false);
        const KeyRange k = tokens_keys(p, len, tok0, min(pack, p.query_len - tok0), 0, 1).keys;
        const int blocks = k.start < k.end ? (k.end + BLOCK - 1) / BLOCK - k.start / BLOCK : 0;
        line[j] = blocks + seg;
        my_longest = max(my_longest, blocks + seg);
    }
    atomicMax(&longest, my_longest);
    if (threadIdx.x == 0) line[jobs] = 0;
    __syncthreads();
    const int total = block_scan(line, jobs + 1, sums);
    const int share = max(max(aligned_share((total + sp.ctas - 1) / sp.ctas, longest), seg + sp.min_blocks), 1);
    if (line_fits) {
        for (int j = threadIdx.x; j <= jobs; j += THREADS) sp.line[j] = line_s[j];
    }
    const auto blocks_of = [&](int j) { return line[j + 1] - line[j] - seg; };

    // 2. Each CTA's first cursor: the job whose stretch of the line holds c * share (the last
    //    one starting at or before it) and its block there; past a job's last block, the next.
    for (int c = threadIdx.x; c <= sp.ctas; c += THREADS) {
        const long long x = min((long long)c * share, (long long)total);
        int job = jobs, block = 0;
        if (c == 0) {
            job = 0;
        } else if (x < total) {
            int lo = 0, hi = jobs;  // jobs whose end (line[j + 1]) is at or before x
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (line[mid + 1] <= x) {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            job = lo;
            const int b = blocks_of(job);
            block = min(max((int)x - line[job] - seg, 0), b);
            if (block == b && b > 0) {
                ++job;
                block = 0;
            }
        }
        sp.begin[2 * c] = job;
        sp.begin[2 * c + 1] = block;
        if (begin_fits) {
            begin[2 * c] = job;
            begin[2 * c + 1] = block;
        }
    }
    __syncthreads();

    // 3. Each job's CTAs and split count; 4. its first workspace slot.
    for (int j = threadIdx.x; j < jobs; j += THREADS) {
        const int b = blocks_of(j);
        const int first = cta_of(begin, sp.ctas, j, 0), last = cta_of(begin, sp.ctas, j, max(b, 1) - 1);
        sp.first_cta[j] = first;
        sp.splits[j] = last - first + 1;
        slots[j] = last - first + 1;
    }
    __syncthreads();
    block_scan(slots, jobs, sums);
    if (line_fits) {
        for (int j = threadIdx.x; j < jobs; j += THREADS) sp.first_slot[j] = slot_s[j];
    }
    if (threadIdx.x == 0) *sp.share = share;
}
