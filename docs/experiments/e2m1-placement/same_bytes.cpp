// gemv_mma.cu's e2m1 placement before version 34 (old_) and since (new_) give the same four bf16
// pairs for every 32-bit data word. g++ -O2 same_bytes.cpp && ./a.out  (about a minute)
#include <cstdint>
#include <cstdio>
static inline void old_(uint32_t w, uint32_t (&out)[4]) {
    for (int p = 0; p < 4; ++p) {
        const int up = 6 - 4 * p;
        const uint32_t mag = up >= 0 ? w << up : w >> -up;
        out[p] = (mag & 0x01C001C0u) | ((mag << 6) & 0x80008000u);
    }
}
static inline void new_(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t words[2] = {w, w >> 8};
    for (int p = 0; p < 4; ++p) {
        const int at = 4 * (p & 1);
        const uint32_t v = words[p >> 1] & (0x000F000Fu << at);
        out[p] = (v * ((1u << (6 - at)) + (1u << (12 - at)))) & 0x81C081C0u;
    }
}
int main() {
    uint64_t bad = 0;
    for (uint64_t x = 0; x < (1ull << 32); ++x) {
        uint32_t a[4], b[4];
        old_((uint32_t)x, a);
        new_((uint32_t)x, b);
        for (int p = 0; p < 4; ++p) bad += a[p] != b[p];
    }
    printf("mismatches: %llu\n", (unsigned long long)bad);
    return bad != 0;
}
