// SPDX-License-Identifier: GPL-2.0-only
/*
 * Helpers shared by the dm-dedup KUnit tests; see dedup-test-util.h.
 */
#include <kunit/resource.h>
#include <kunit/test.h>
#include <linux/bio.h>
#include <linux/blkdev.h>
#include <linux/major.h>
#include <linux/unaligned.h>

#include "dedup-test-util.h"

/* The "Example" superblock of Documentation/dedup-format.rst, bytes 0..191. */
const u8 dd_test_example_sb[192] = {
	0x5a, 0x8b, 0x81, 0xd6, 0x53, 0x55, 0x50, 0x52,
	0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	0x44, 0x44, 0x45, 0x44, 0x55, 0x50, 0x30, 0x31,
	0x01, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00,
	0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00,
	0x73, 0x68, 0x61, 0x32, 0x35, 0x36, 0x00, 0x00,
	[104] = 0x20,
	[184] = 0xf5, 0x5a, 0x02, 0x6b,
};

KUNIT_DEFINE_ACTION_WRAPPER(dd_test_bdev_put, bdev_fput, struct file *);
KUNIT_DEFINE_ACTION_WRAPPER(dd_test_bm_put, dd_bm_destroy, struct dd_bm *);
KUNIT_DEFINE_ACTION_WRAPPER(dd_test_md_put, dd_md_close, struct dd_metadata *);

struct block_device *dd_test_dev_open(struct kunit *test)
{
	struct block_device *bdev;
	struct file *file;
	int r;

	file = bdev_file_open_by_dev(MKDEV(RAMDISK_MAJOR, 0),
				     BLK_OPEN_READ | BLK_OPEN_WRITE, test,
				     NULL);
	KUNIT_ASSERT_NOT_ERR_OR_NULL_MSG(test, file, "cannot open ram0");
	r = kunit_add_action_or_reset(test, dd_test_bdev_put, file);
	KUNIT_ASSERT_EQ(test, r, 0);
	bdev = file_bdev(file);
	KUNIT_ASSERT_EQ_MSG(test, bdev_nr_bytes(bdev) >> DD_BLOCK_SHIFT,
			    DD_TEST_DEV_BLOCKS,
			    "ram0 has the wrong size: CONFIG_BLK_DEV_RAM_SIZE");
	/* brd frees the pages of a discarded range: they read back as zeros. */
	r = blkdev_issue_discard(bdev, 0, bdev_nr_sectors(bdev), GFP_KERNEL);
	KUNIT_ASSERT_EQ(test, r, 0);
	return bdev;
}

/* Block I/O that bypasses dm-bufio and its checksumming write callback. */
static void dd_test_rw(struct kunit *test, struct block_device *bdev, u64 nr,
		       void *buf, blk_opf_t opf)
{
	struct bio_vec bvec;
	struct bio bio;
	int r;

	KUNIT_ASSERT_TRUE(test, IS_ALIGNED((unsigned long)buf, DD_BLOCK_SIZE));
	bio_init(&bio, bdev, &bvec, 1, opf);
	bio.bi_iter.bi_sector = nr * DD_SECTORS_PER_BLOCK;
	__bio_add_page(&bio, virt_to_page(buf), DD_BLOCK_SIZE, 0);
	r = submit_bio_wait(&bio);
	bio_uninit(&bio);
	KUNIT_ASSERT_EQ(test, r, 0);
}

void dd_test_read_block(struct kunit *test, struct block_device *bdev,
			u64 nr, void *buf)
{
	dd_test_rw(test, bdev, nr, buf, REQ_OP_READ);
}

void dd_test_write_block(struct kunit *test, struct block_device *bdev,
			 u64 nr, const void *buf)
{
	dd_test_rw(test, bdev, nr, (void *)buf, REQ_OP_WRITE | REQ_FUA);
}

void dd_test_flip_bit(struct kunit *test, struct block_device *bdev,
		      u64 nr, unsigned int byte, unsigned int bit)
{
	u8 *buf = kunit_kmalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, buf);
	dd_test_read_block(test, bdev, nr, buf);
	buf[byte] ^= 1U << bit;
	dd_test_write_block(test, bdev, nr, buf);
	kunit_kfree(test, buf);
}

struct dd_bm *dd_test_bm_create(struct kunit *test, struct block_device *bdev,
				u64 nr_blocks)
{
	struct dd_bm *bm;
	int r;

	r = dd_bm_create(bdev, nr_blocks, &bm);
	KUNIT_ASSERT_EQ(test, r, 0);
	r = kunit_add_action_or_reset(test, dd_test_bm_put, bm);
	KUNIT_ASSERT_EQ(test, r, 0);
	return bm;
}

void dd_test_bm_destroy(struct kunit *test, struct dd_bm *bm)
{
	kunit_release_action(test, dd_test_bm_put, bm);
}

/*
 * What dd_md_commit() does to the block manager, minus the superblock:
 * enough for tests of blocks and arrays that never open the metadata.
 */
void dd_test_bm_commit(struct kunit *test, struct dd_bm *bm)
{
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_bm_next_txn(bm);
	dd_space_commit(&bm->space, NULL, NULL);
}

void dd_test_md_config(struct dd_md_config *cfg, u64 logical_blocks,
		       u64 data_blocks)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->logical_blocks = logical_blocks;
	cfg->data_blocks = data_blocks;
	cfg->hash_name = "sha256";
	cfg->fp_size = DD_FP_SIZE;
}

struct dd_metadata *dd_test_md_open(struct kunit *test,
				    struct block_device *bdev,
				    const struct dd_md_config *cfg)
{
	struct dd_metadata *md = NULL;
	char *error = NULL;
	int r;

	r = dd_md_open(bdev, cfg, &md, &error);
	KUNIT_ASSERT_EQ_MSG(test, r, 0, "dd_md_open: %s", error ?: "");
	r = kunit_add_action_or_reset(test, dd_test_md_put, md);
	KUNIT_ASSERT_EQ(test, r, 0);
	return md;
}

void dd_test_md_close(struct kunit *test, struct dd_metadata *md)
{
	kunit_release_action(test, dd_test_md_put, md);
}

/* A fingerprint-like value, distinct per seed and never all zeros. */
void dd_test_fp(u8 *fp, u64 seed)
{
	u64 x = seed, z;
	int i;

	/*
	 * splitmix64: a bijection of its state, so distinct seeds give
	 * distinct first words, and at most one word of four can be zero.
	 */
	for (i = 0; i < DD_FP_SIZE; i += sizeof(u64)) {
		x += 0x9e3779b97f4a7c15ULL;
		z = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
		put_unaligned_le64(z ^ (z >> 31), fp + i);
	}
}

/*
 * CRC-32C straight from its definition in Documentation/dedup-format.rst,
 * one bit at a time: an oracle that shares no code with lib/crc32.
 */
u32 dd_test_crc32c(const void *data, size_t len)
{
	const u8 *p = data;
	u32 crc = ~0U;
	int k;

	while (len--) {
		crc ^= *p++;
		for (k = 0; k < 8; k++)
			crc = (crc >> 1) ^ ((crc & 1) ? 0x82f63b78 : 0);
	}
	return ~crc;
}

static void dd_test_group_done(struct dd_io_group *g, bool failed)
{
	struct dd_test_group *t = container_of(g, struct dd_test_group, g);

	t->calls++;
	t->failed = failed;
}

void dd_test_group_init(struct dd_test_group *t, unsigned int parts)
{
	t->calls = 0;
	t->failed = false;
	dd_io_group_init(&t->g, parts, dd_test_group_done);
}
