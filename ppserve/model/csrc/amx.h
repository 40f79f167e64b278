/* Intel AMX tile set-up shared by the AMX kernels. Defines HAVE_AMX where the compiler targets AMX-BF16
 * (-march=native on such a CPU). Every kernel uses the same palette: 8 tiles of 16 rows x 64 bytes. */
#ifndef PPSERVE_AMX_H
#define PPSERVE_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tile state is per thread: each OpenMP thread configures before its first tile instruction (and
 * oneDNN reconfigures before its own). The GEMM's blocks of fewer than 32 rows set the row counts of
 * tiles 0, 1, 4 (`top`: accumulators and A tile of rows 0-15) and 2, 3, 5 (`bottom`: rows 16-31; 0 leaves
 * them unused), so that the tile unit multiplies and loads only the rows that exist. */
static inline void configure_tile_rows(int top, int bottom) {
    static const int8_t half[8] = {0, 0, 1, 1, 0, 1, -1, -1}; /* which rows a tile holds; -1: B, 16 k pairs */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(half[t] < 0 ? 16 : half[t] ? bottom : top);
        cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

static inline void configure_tiles(void) { configure_tile_rows(16, 16); }
#endif
#endif /* PPSERVE_AMX_H */
