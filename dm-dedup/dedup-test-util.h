/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Helpers shared by the dm-dedup KUnit tests (CONFIG_DM_DEDUP_KUNIT_TEST).
 *
 * The metadata tests need a real block device under dm-bufio: they use the
 * first ram disk (brd), emptied at the start of every test so that no test
 * sees what another one left. Everything a helper opens is closed by KUnit
 * when the test ends, also when an assertion stops it half way.
 */
#ifndef DM_DEDUP_TEST_UTIL_H
#define DM_DEDUP_TEST_UTIL_H

#include <kunit/test.h>
#include <linux/blkdev.h>

#include "dedup-block.h"
#include "dedup-metadata.h"

extern const u8 dd_test_example_sb[192];

/* brd's default geometry comes from .kunitconfig; the tests rely on it. */
#define DD_TEST_DEV_BLOCKS	4096

struct block_device *dd_test_dev_open(struct kunit *test);

void dd_test_read_block(struct kunit *test, struct block_device *bdev,
			u64 nr, void *buf);
void dd_test_write_block(struct kunit *test, struct block_device *bdev,
			 u64 nr, const void *buf);
void dd_test_flip_bit(struct kunit *test, struct block_device *bdev,
		      u64 nr, unsigned int byte, unsigned int bit);

struct dd_bm *dd_test_bm_create(struct kunit *test, struct block_device *bdev,
				u64 nr_blocks);
void dd_test_bm_destroy(struct kunit *test, struct dd_bm *bm);
void dd_test_bm_commit(struct kunit *test, struct dd_bm *bm);

void dd_test_md_config(struct dd_md_config *cfg, u64 logical_blocks,
		       u64 data_blocks);
struct dd_metadata *dd_test_md_open(struct kunit *test,
				    struct block_device *bdev,
				    const struct dd_md_config *cfg);
void dd_test_md_close(struct kunit *test, struct dd_metadata *md);

void dd_test_fp(u8 *fp, u64 seed);
u32 dd_test_crc32c(const void *data, size_t len);

/* An I/O group whose end counts its calls and keeps what it was told. */
struct dd_test_group {
	struct dd_io_group g;
	int calls;
	bool failed;
};

void dd_test_group_init(struct dd_test_group *t, unsigned int parts);

#endif
