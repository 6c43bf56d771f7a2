// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of metadata blocks (dedup-block.c): checksums, the on-disk
 * header and superblock encoding, validation on read, shadowing and the
 * superblock slots. The vectors come from Documentation/dedup-format.rst,
 * which the userspace tools are written from: if these tests fail, the
 * kernel and the tools no longer read the same format.
 */
#include <kunit/test.h>
#include <linux/dm-bufio.h>
#include <linux/stddef.h>

#include "dedup-block.h"
#include "dedup-test-util.h"

static void *dd_test_block(struct kunit *test)
{
	void *p = kunit_kzalloc(test, DD_BLOCK_SIZE, GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, p);
	return p;
}

static const struct dd_block_kind dd_leaf2 = {
	.type = DD_BT_LEAF, .array = DD_ARRAY_REFCOUNT, .level = 0,
};

/* @n new leaves of the running transaction, changed and released. */
static void dd_test_new_leaves(struct kunit *test, struct dd_bm *bm,
			       unsigned int n)
{
	struct dd_block blk;

	while (n--) {
		KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
		dd_bm_release_dirty(&blk);
	}
}

static void dd_block_test_csum_zero_vector(struct kunit *test)
{
	u8 *blk = dd_test_block(test);

	KUNIT_EXPECT_EQ(test, dd_block_csum(blk), 0xA732586E);
	/* bytes 0..3 hold the checksum and are not covered by it */
	memset(blk, 0xff, 4);
	KUNIT_EXPECT_EQ(test, dd_block_csum(blk), 0xA732586E);
	KUNIT_EXPECT_FALSE(test, dd_block_csum_ok(blk));
	put_unaligned_le32(0xA732586E, blk);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(blk));
	/* the documented on-disk byte order */
	KUNIT_EXPECT_EQ(test, blk[0], 0x6e);
	KUNIT_EXPECT_EQ(test, blk[3], 0xa7);
}

static void dd_block_test_csum_reference(struct kunit *test)
{
	u8 *blk = dd_test_block(test);
	unsigned int i;

	/* the oracle itself against the standard CRC-32C check value */
	KUNIT_ASSERT_EQ(test, dd_test_crc32c("123456789", 9), 0xE3069283);
	for (i = 0; i < DD_BLOCK_SIZE; i++)
		blk[i] = i * 37 + (i >> 8);
	KUNIT_EXPECT_EQ(test, dd_block_csum(blk),
			dd_test_crc32c(blk + 4, DD_BLOCK_SIZE - 4));
}

/* Any single flipped bit after the checksum field is caught. */
static void dd_block_test_csum_flips(struct kunit *test)
{
	static const unsigned int bytes[] = { 4, 7, 8, 31, 32, 33, 2047, 4094,
					      4095 };
	u8 *blk = dd_test_block(test);
	unsigned int i, bit;

	for (i = 0; i < DD_BLOCK_SIZE; i++)
		blk[i] = i ^ 0x5a;
	put_unaligned_le32(dd_block_csum(blk), blk);
	KUNIT_ASSERT_TRUE(test, dd_block_csum_ok(blk));
	for (i = 0; i < ARRAY_SIZE(bytes); i++) {
		for (bit = 0; bit < 8; bit++) {
			blk[bytes[i]] ^= 1U << bit;
			KUNIT_EXPECT_FALSE_MSG(test, dd_block_csum_ok(blk),
					       "byte %u bit %u", bytes[i], bit);
			blk[bytes[i]] ^= 1U << bit;
		}
	}
	/* and so is damage to the stored checksum itself */
	blk[1] ^= 0x10;
	KUNIT_EXPECT_FALSE(test, dd_block_csum_ok(blk));
	blk[1] ^= 0x10;
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(blk));
}

/* Offsets as tabulated in Documentation/dedup-format.rst. */
static void dd_block_test_layout(struct kunit *test)
{
	KUNIT_EXPECT_EQ(test, sizeof(struct dd_block_header), DD_HEADER_SIZE);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_block_header, type), 4);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_block_header, blocknr), 8);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_block_header, txn), 16);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_block_header, array), 24);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_block_header, level), 25);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_block_header, reserved2), 28);
	KUNIT_EXPECT_EQ(test, sizeof(struct dd_superblock), 240);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, saved_root), 192);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, saved_words), 200);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, magic), 32);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, version), 40);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, block_size), 44);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, metadata_blocks),
			48);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, data_blocks), 56);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, logical_blocks),
			64);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, hash_name), 72);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, fp_size), 104);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, flags), 108);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, map_root), 112);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, refcount_root),
			120);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, fingerprint_root),
			128);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, mapped_blocks),
			136);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, used_data_blocks),
			144);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, discarded_blocks),
			176);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, format_time), 184);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, journal_start), 208);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_superblock, journal_id), 232);
	KUNIT_EXPECT_EQ(test, sizeof(struct dd_journal_header),
			DD_JOURNAL_HEADER_SIZE);
	KUNIT_EXPECT_EQ(test, offsetof(struct dd_journal_header, seq), 48);
	KUNIT_EXPECT_EQ(test, DD_INTERIOR_FANOUT, 508);
}

/* The documented bytes decode to the documented values. */
static void dd_block_test_superblock_decode(struct kunit *test)
{
	u8 *blk = dd_test_block(test);
	const struct dd_superblock *sb = (const void *)blk;

	memcpy(blk, dd_test_example_sb, sizeof(dd_test_example_sb));
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(blk));
	KUNIT_EXPECT_EQ(test, dd_block_csum(blk), 0xD6818B5A);
	KUNIT_EXPECT_EQ(test, le32_to_cpu(sb->hdr.type), DD_BT_SUPER);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->hdr.blocknr), 1);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->hdr.txn), 1);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->magic), DD_SB_MAGIC);
	/* The documentation's example predates the journal: version 1. */
	KUNIT_EXPECT_EQ(test, le32_to_cpu(sb->version), DD_FORMAT_VERSION_V1);
	KUNIT_EXPECT_EQ(test, le32_to_cpu(sb->block_size), DD_BLOCK_SIZE);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->metadata_blocks), 4096);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->data_blocks), 16384);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->logical_blocks), 65536);
	KUNIT_EXPECT_STREQ(test, sb->hash_name, "sha256");
	KUNIT_EXPECT_EQ(test, le32_to_cpu(sb->fp_size), 32);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->map_root), 0);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(sb->format_time), 1795316469);
}

/* Fields set through the structure give the documented bytes. */
static void dd_block_test_superblock_encode(struct kunit *test)
{
	u8 *blk = dd_test_block(test);
	struct dd_superblock *sb = (void *)blk;

	sb->hdr.type = cpu_to_le32(DD_BT_SUPER);
	sb->hdr.blocknr = cpu_to_le64(1);
	sb->hdr.txn = cpu_to_le64(1);
	sb->magic = cpu_to_le64(DD_SB_MAGIC);
	sb->version = cpu_to_le32(DD_FORMAT_VERSION_V1);
	sb->block_size = cpu_to_le32(DD_BLOCK_SIZE);
	sb->metadata_blocks = cpu_to_le64(4096);
	sb->data_blocks = cpu_to_le64(16384);
	sb->logical_blocks = cpu_to_le64(65536);
	strscpy(sb->hash_name, "sha256", sizeof(sb->hash_name));
	sb->fp_size = cpu_to_le32(32);
	sb->format_time = cpu_to_le64(1795316469);
	sb->hdr.csum = cpu_to_le32(dd_block_csum(blk));
	KUNIT_EXPECT_MEMEQ(test, blk, dd_test_example_sb, 192);
	KUNIT_EXPECT_NULL(test, memchr_inv(blk + 192, 0, DD_BLOCK_SIZE - 192));
}

/* A block written through the manager reads back, header and payload. */
static void dd_block_test_write_read(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	const struct dd_block_header *h;
	struct dd_block blk;
	u8 *raw = dd_test_block(test);
	unsigned int i;

	bm->txn = 5;
	KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
	/* blocks 0 and 1 are the superblock slots */
	KUNIT_EXPECT_EQ(test, blk.nr, DD_FIRST_TREE_BLOCK);
	KUNIT_EXPECT_NULL(test, memchr_inv(dd_payload(&blk), 0,
					   DD_PAYLOAD_SIZE));
	for (i = 0; i < DD_PAYLOAD_SIZE; i++)
		((u8 *)dd_payload(&blk))[i] = i % 251;
	dd_bm_release_dirty(&blk);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_test_bm_destroy(test, bm);

	dd_test_read_block(test, bdev, 2, raw);
	h = (const void *)raw;
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	KUNIT_EXPECT_EQ(test, le32_to_cpu(h->type), DD_BT_LEAF);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(h->blocknr), 2);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(h->txn), 5);
	KUNIT_EXPECT_EQ(test, h->array, DD_ARRAY_REFCOUNT);
	KUNIT_EXPECT_EQ(test, h->level, 0);
	KUNIT_EXPECT_EQ(test, le16_to_cpu(h->reserved1), 0);
	KUNIT_EXPECT_EQ(test, le32_to_cpu(h->reserved2), 0);
	for (i = 0; i < DD_PAYLOAD_SIZE; i++)
		KUNIT_ASSERT_EQ(test, raw[DD_HEADER_SIZE + i], i % 251);

	/* reopened, as activation does: the next transaction runs */
	bm = dd_test_bm_create(test, bdev, 16);
	bm->txn = 6;
	KUNIT_ASSERT_EQ(test, dd_bm_read(bm, 2, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_MEMEQ(test, blk.data, raw, DD_BLOCK_SIZE);
	dd_bm_release(&blk);
}

/* Damage and misplacement are refused with -EILSEQ, never returned. */
static void dd_block_test_read_validation(struct kunit *test)
{
	static const struct dd_block_kind interior = {
		.type = DD_BT_INTERIOR, .array = DD_ARRAY_REFCOUNT, .level = 1,
	};
	static const struct dd_block_kind other_array = {
		.type = DD_BT_LEAF, .array = DD_ARRAY_MAP, .level = 0,
	};
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	u8 *raw = dd_test_block(test);
	struct dd_block blk;

	bm->txn = 1;
	dd_test_new_leaves(test, bm, 2);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_test_bm_destroy(test, bm);

	/* block 2 copied to block 4: a misdirected write */
	dd_test_read_block(test, bdev, 2, raw);
	dd_test_write_block(test, bdev, 4, raw);
	/* one bit of block 3's payload */
	dd_test_flip_bit(test, bdev, 3, 1000, 6);

	bm = dd_test_bm_create(test, bdev, 16);
	bm->txn = 2;
	KUNIT_ASSERT_EQ(test, dd_bm_read(bm, 2, &dd_leaf2, &blk), 0);
	dd_bm_release(&blk);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 2, &interior, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 2, &other_array, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 3, &dd_leaf2, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 4, &dd_leaf2, &blk), -EILSEQ);
	/* never written: zeros do not carry a valid checksum */
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 5, &dd_leaf2, &blk), -EILSEQ);
	/* the superblock slots and the end are no tree blocks */
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 0, &dd_leaf2, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 1, &dd_leaf2, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 16, &dd_leaf2, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, U64_MAX, &dd_leaf2, &blk),
			-EILSEQ);
	/* a damaged block stays refused on the next read, from the cache */
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 3, &dd_leaf2, &blk), -EILSEQ);
}

/* The non-blocking read never waits for I/O. */
static void dd_block_test_read_cached(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	struct dd_block blk;

	bm->txn = 1;
	dd_test_new_leaves(test, bm, 1);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_test_bm_destroy(test, bm);

	bm = dd_test_bm_create(test, bdev, 16);
	bm->txn = 2;
	KUNIT_EXPECT_EQ(test, dd_bm_read_cached(bm, 2, &dd_leaf2, &blk),
			-EWOULDBLOCK);
	KUNIT_ASSERT_EQ(test, dd_bm_read(bm, 2, &dd_leaf2, &blk), 0);
	dd_bm_release(&blk);
	KUNIT_EXPECT_EQ(test, dd_bm_read_cached(bm, 2, &dd_leaf2, &blk), 0);
	dd_bm_release(&blk);
	KUNIT_EXPECT_EQ(test, dd_bm_read_cached(bm, 1, &dd_leaf2, &blk),
			-EILSEQ);
}

/*
 * Shadowing: a block of the running transaction changes in place; a
 * committed one is copied, and the copy's changes never reach it.
 */
static void dd_block_test_shadow(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	u8 *raw = dd_test_block(test);
	struct dd_block blk;
	u64 used;

	bm->txn = 1;
	KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
	KUNIT_ASSERT_EQ(test, blk.nr, 2);
	memset(dd_payload(&blk), 0xaa, DD_PAYLOAD_SIZE);
	dd_bm_release_dirty(&blk);

	used = bm->space.nr_used;
	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 2, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 2);
	memset(dd_payload(&blk), 0xbb, DD_PAYLOAD_SIZE);
	dd_bm_release_dirty(&blk);
	KUNIT_EXPECT_EQ(test, bm->space.nr_used, used);
	KUNIT_EXPECT_EQ(test, bm->space.nr_pending, 0);

	dd_test_bm_commit(test, bm);
	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 2, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 3);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(dd_hdr(&blk)->blocknr), 3);
	KUNIT_EXPECT_EQ(test, le64_to_cpu(dd_hdr(&blk)->txn), 2);
	KUNIT_EXPECT_EQ(test, ((u8 *)dd_payload(&blk))[0], 0xbb);
	KUNIT_EXPECT_EQ(test, ((u8 *)dd_payload(&blk))[DD_PAYLOAD_SIZE - 1],
			0xbb);
	memset(dd_payload(&blk), 0xcc, DD_PAYLOAD_SIZE);
	dd_bm_release_dirty(&blk);
	/* the original stays allocated until the transaction commits */
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(&bm->space, 2));
	KUNIT_EXPECT_EQ(test, bm->space.nr_pending, 1);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);

	dd_test_read_block(test, bdev, 2, raw);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	KUNIT_EXPECT_EQ(test, le64_to_cpu(((struct dd_block_header *)raw)->txn),
			1);
	KUNIT_EXPECT_EQ(test, raw[DD_HEADER_SIZE], 0xbb);
	dd_test_read_block(test, bdev, 3, raw);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	KUNIT_EXPECT_EQ(test, raw[DD_BLOCK_SIZE - 1], 0xcc);

	dd_test_bm_commit(test, bm);
	KUNIT_EXPECT_FALSE(test, dd_space_is_used(&bm->space, 2));
}

/*
 * On a device with room for four tree blocks: the originals of shadowed
 * blocks are not handed out again before the commit, even when nothing
 * else is left.
 */
static void dd_block_test_no_reuse_before_commit(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 6);
	struct dd_block blk;

	bm->txn = 1;
	dd_test_new_leaves(test, bm, 2);
	dd_test_bm_commit(test, bm);

	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 2, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 4);
	dd_bm_release_dirty(&blk);
	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 3, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 5);
	dd_bm_release_dirty(&blk);
	KUNIT_EXPECT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), -ENOSPC);
	KUNIT_EXPECT_EQ(test, dd_bm_shadow(bm, 4, &dd_leaf2, &blk), 0);
	dd_bm_release(&blk);

	dd_test_bm_commit(test, bm);
	KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 2);
	dd_bm_release_dirty(&blk);
	KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 3);
	dd_bm_release_dirty(&blk);
	KUNIT_EXPECT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), -ENOSPC);
	/* a full device does not harm a block held for shadowing */
	KUNIT_EXPECT_EQ(test, dd_bm_shadow(bm, 4, &dd_leaf2, &blk), -ENOSPC);
	KUNIT_EXPECT_TRUE(test, dd_space_is_used(&bm->space, 4));
	KUNIT_EXPECT_EQ(test, bm->space.nr_pending, 0);
}

/*
 * Whether a block changes in place is decided by what this transaction
 * allocated, not by the block's header; a committed block that claims the
 * running transaction (damage, an older superblock slot, a bad restore)
 * is refused instead of being changed under the commit that holds it.
 */
static void dd_block_test_txn_from_ram(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	u8 *raw = dd_test_block(test);
	struct dd_block blk;

	bm->txn = 1;
	dd_test_new_leaves(test, bm, 2);
	dd_test_bm_commit(test, bm);
	dd_test_bm_destroy(test, bm);

	/* block 3 now claims transaction 2, the one about to run */
	dd_test_read_block(test, bdev, 3, raw);
	((struct dd_block_header *)raw)->txn = cpu_to_le64(2);
	((struct dd_block_header *)raw)->csum = cpu_to_le32(dd_block_csum(raw));
	dd_test_write_block(test, bdev, 3, raw);

	bm = dd_test_bm_create(test, bdev, 16);
	bm->txn = 2;
	dd_space_mark_used(&bm->space, 2);
	dd_space_mark_used(&bm->space, 3);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 3, &dd_leaf2, &blk), -EILSEQ);
	KUNIT_EXPECT_EQ(test, dd_bm_shadow(bm, 3, &dd_leaf2, &blk), -EILSEQ);
	/* an honest committed block is copied, its copy then changed in place */
	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 2, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 4);
	dd_bm_release_dirty(&blk);
	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 4, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 4);
	dd_bm_release_dirty(&blk);
	/* after the commit, the copy is committed too and is copied again */
	dd_test_bm_commit(test, bm);
	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 4, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_NE(test, blk.nr, 4);
	dd_bm_release_dirty(&blk);
}

/*
 * A block of the running transaction whose write was lost (dm-bufio drops
 * a buffer whose background write failed) reads back what the location
 * held before: a valid, older block. It is refused, never served.
 */
static void dd_block_test_lost_write(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	u8 *old = dd_test_block(test);
	struct dd_block_header *h = (void *)old;
	struct dd_block blk;
	u64 nr;

	bm->txn = 1;
	dd_test_new_leaves(test, bm, 1);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_test_read_block(test, bdev, 2, old);
	dd_test_bm_commit(test, bm);

	KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
	nr = blk.nr;
	memset(dd_payload(&blk), 0x5a, DD_PAYLOAD_SIZE);
	dd_bm_release_dirty(&blk);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);

	/*
	 * The write never reached the disk, which holds what an earlier
	 * transaction left at that location: checksum and location valid.
	 */
	h->blocknr = cpu_to_le64(nr);
	h->csum = cpu_to_le32(dd_block_csum(old));
	dd_test_write_block(test, bdev, nr, old);
	dm_bufio_forget(bm->bufio, nr);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, nr, &dd_leaf2, &blk), -ESTALE);
	KUNIT_EXPECT_EQ(test, dd_bm_shadow(bm, nr, &dd_leaf2, &blk), -ESTALE);

	/*
	 * A location never written before holds zeros, which fail the
	 * checksum: still a lost write of the transaction, not damage.
	 */
	memset(old, 0, DD_BLOCK_SIZE);
	dd_test_write_block(test, bdev, nr, old);
	dm_bufio_forget(bm->bufio, nr);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, nr, &dd_leaf2, &blk), -ESTALE);
	/* The same bytes in a block the transaction did not write: damage. */
	KUNIT_ASSERT_FALSE(test, dd_bm_is_fresh(bm, 8));
	dd_test_write_block(test, bdev, 8, old);
	KUNIT_EXPECT_EQ(test, dd_bm_read(bm, 8, &dd_leaf2, &blk), -EILSEQ);
}

/*
 * A write dm-bufio starts on its own is flagged, so that its error is asked
 * for before the next commit; writes of dd_bm_write_all() are not.
 */
static void dd_block_test_background_write(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);

	bm->txn = 1;
	dd_test_new_leaves(test, bm, 1);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	KUNIT_EXPECT_FALSE(test, dd_bm_background_writes(bm));
	KUNIT_EXPECT_EQ(test, dd_bm_writeback_error(bm), 0);

	dd_test_new_leaves(test, bm, 1);
	/* What dm-bufio does when dirty buffers outnumber clean ones. */
	dm_bufio_write_dirty_buffers_async(bm->bufio);
	KUNIT_EXPECT_TRUE(test, dd_bm_background_writes(bm));
	KUNIT_EXPECT_EQ(test, dd_bm_writeback_error(bm), 0);
	KUNIT_EXPECT_FALSE(test, dd_bm_background_writes(bm));

	/*
	 * The same while another thread writes out: its write-out may have
	 * taken dm-bufio's errors already, so this one's is still to ask.
	 * Slots are only compared, so any pointer but ours stands for it.
	 */
	bm->out_tasks[0] = (struct task_struct *)test;
	dd_test_new_leaves(test, bm, 1);
	dm_bufio_write_dirty_buffers_async(bm->bufio);
	bm->out_tasks[0] = NULL;
	KUNIT_EXPECT_TRUE(test, dd_bm_background_writes(bm));
	KUNIT_EXPECT_EQ(test, dd_bm_writeback_error(bm), 0);
}

/*
 * A write-ahead is not background writeback, and a block changed after it
 * is written again, checksum and all, by the next write-out.
 */
static void dd_block_test_write_ahead(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	u8 *raw = dd_test_block(test);
	struct dd_block blk;

	bm->txn = 1;
	KUNIT_ASSERT_EQ(test, dd_bm_new(bm, &dd_leaf2, &blk), 0);
	KUNIT_ASSERT_EQ(test, blk.nr, 2);
	memset(dd_payload(&blk), 0xaa, DD_PAYLOAD_SIZE);
	dd_bm_release_dirty(&blk);
	dd_bm_write_ahead(bm);
	KUNIT_EXPECT_FALSE(test, dd_bm_background_writes(bm));
	dd_test_read_block(test, bdev, 2, raw);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	KUNIT_EXPECT_EQ(test, raw[DD_HEADER_SIZE], 0xaa);

	KUNIT_ASSERT_EQ(test, dd_bm_shadow(bm, 2, &dd_leaf2, &blk), 0);
	KUNIT_EXPECT_EQ(test, blk.nr, 2);
	memset(dd_payload(&blk), 0xbb, DD_PAYLOAD_SIZE);
	dd_bm_release_dirty(&blk);
	KUNIT_ASSERT_EQ(test, dd_bm_write_all(bm), 0);
	dd_test_read_block(test, bdev, 2, raw);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	KUNIT_EXPECT_EQ(test, raw[DD_HEADER_SIZE], 0xbb);
	KUNIT_EXPECT_EQ(test, raw[DD_BLOCK_SIZE - 1], 0xbb);
}

/* Generation g goes to slot g % 2, as a full 4 KiB block. */
static void dd_block_test_super_slots(struct kunit *test)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dd_bm *bm = dd_test_bm_create(test, bdev, 16);
	struct dd_superblock *sb;
	u8 *raw = dd_test_block(test), *slot1 = dd_test_block(test);

	sb = kunit_kzalloc(test, sizeof(*sb), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, sb);
	sb->hdr.type = cpu_to_le32(DD_BT_SUPER);
	sb->hdr.txn = cpu_to_le64(7);
	/* a wrong blocknr must be corrected to the slot */
	sb->hdr.blocknr = cpu_to_le64(12345);
	sb->magic = cpu_to_le64(DD_SB_MAGIC);
	sb->map_root = cpu_to_le64(0x0102030405060708ULL);
	sb->format_time = cpu_to_le64(U64_MAX);
	KUNIT_ASSERT_EQ(test, dd_bm_write_super(bm, sb), 0);

	dd_test_read_block(test, bdev, 0, raw);
	KUNIT_EXPECT_NULL(test, memchr_inv(raw, 0, DD_BLOCK_SIZE));
	dd_test_read_block(test, bdev, 1, slot1);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(slot1));
	KUNIT_EXPECT_EQ(test, get_unaligned_le32(slot1 + 4), DD_BT_SUPER);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(slot1 + 8), 1);
	KUNIT_EXPECT_MEMEQ(test, slot1 + 16, (u8 *)sb + 16, sizeof(*sb) - 16);
	KUNIT_EXPECT_NULL(test, memchr_inv(slot1 + sizeof(*sb), 0,
					   DD_BLOCK_SIZE - sizeof(*sb)));

	sb->hdr.txn = cpu_to_le64(8);
	KUNIT_ASSERT_EQ(test, dd_bm_write_super(bm, sb), 0);
	dd_test_read_block(test, bdev, 0, raw);
	KUNIT_EXPECT_TRUE(test, dd_block_csum_ok(raw));
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + 8), 0);
	KUNIT_EXPECT_EQ(test, get_unaligned_le64(raw + 16), 8);
	/* the other slot keeps the previous generation */
	dd_test_read_block(test, bdev, 1, raw);
	KUNIT_EXPECT_MEMEQ(test, raw, slot1, DD_BLOCK_SIZE);
}

/*
 * A group ends once, at the put of its last part, and says whether any
 * part failed; parts added on the way count as well.
 */
static void dd_block_test_io_group(struct kunit *test)
{
	struct dd_test_group t;

	dd_test_group_init(&t, 2);
	dd_io_group_put(&t.g, BLK_STS_OK);
	dd_io_group_get(&t.g);
	dd_io_group_put(&t.g, BLK_STS_OK);
	KUNIT_EXPECT_EQ(test, t.calls, 0);
	dd_io_group_put(&t.g, BLK_STS_OK);
	KUNIT_EXPECT_EQ(test, t.calls, 1);
	KUNIT_EXPECT_FALSE(test, t.failed);

	dd_test_group_init(&t, 2);
	dd_io_group_put(&t.g, BLK_STS_IOERR);
	KUNIT_EXPECT_EQ(test, t.calls, 0);
	dd_io_group_put(&t.g, BLK_STS_OK);
	KUNIT_EXPECT_EQ(test, t.calls, 1);
	KUNIT_EXPECT_TRUE(test, t.failed);
}

static struct kunit_case dd_block_cases[] = {
	KUNIT_CASE(dd_block_test_csum_zero_vector),
	KUNIT_CASE(dd_block_test_csum_reference),
	KUNIT_CASE(dd_block_test_csum_flips),
	KUNIT_CASE(dd_block_test_layout),
	KUNIT_CASE(dd_block_test_superblock_decode),
	KUNIT_CASE(dd_block_test_superblock_encode),
	KUNIT_CASE(dd_block_test_write_read),
	KUNIT_CASE(dd_block_test_read_validation),
	KUNIT_CASE(dd_block_test_read_cached),
	KUNIT_CASE(dd_block_test_shadow),
	KUNIT_CASE(dd_block_test_no_reuse_before_commit),
	KUNIT_CASE(dd_block_test_txn_from_ram),
	KUNIT_CASE(dd_block_test_lost_write),
	KUNIT_CASE(dd_block_test_background_write),
	KUNIT_CASE(dd_block_test_write_ahead),
	KUNIT_CASE(dd_block_test_super_slots),
	KUNIT_CASE(dd_block_test_io_group),
	{}
};

static struct kunit_suite dd_block_suite = {
	.name = "dm_dedup_block",
	.test_cases = dd_block_cases,
};

kunit_test_suite(dd_block_suite);
