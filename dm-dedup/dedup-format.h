/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * On-disk format of the dm-dedup metadata device.
 *
 * Documentation/dedup-format.rst describes it in prose; the userspace tools
 * are written from that document, so any change here changes the document
 * too, and a change that a reader of the current version would misread
 * must bump DD_FORMAT_VERSION.
 */
#ifndef DM_DEDUP_FORMAT_H
#define DM_DEDUP_FORMAT_H

#include <linux/limits.h>
#include <linux/types.h>

#define DD_BLOCK_SIZE		4096
#define DD_BLOCK_SHIFT		12
#define DD_SECTORS_PER_BLOCK	(DD_BLOCK_SIZE >> SECTOR_SHIFT)

#define DD_SB_MAGIC		0x3130505544454444ULL	/* "DDEDUP01" */
#define DD_FORMAT_VERSION	2	/* 1: the same without a journal */
#define DD_FORMAT_VERSION_V1	1
/*
 * The highest transaction id a superblock may carry: room for 2^32 more
 * commits, so that the id never wraps and an older slot never outranks
 * the newer one. Anything above is damage.
 */
#define DD_MAX_TXN		(U64_MAX - (1ULL << 32))

/* Two superblock slots; the valid one with the higher generation wins. */
#define DD_SB_SLOTS		2
#define DD_FIRST_TREE_BLOCK	DD_SB_SLOTS

/* Block types, in every block header. */
#define DD_BT_SUPER		0x52505553	/* "SUPR" */
#define DD_BT_INTERIOR		0x52544e49	/* "INTR" */
#define DD_BT_LEAF		0x4641454c	/* "LEAF" */
#define DD_BT_JOURNAL		0x4c4e524a	/* "JRNL" */

/* The three persistent arrays; the id is stored in every tree block. */
enum dd_array_id {
	DD_ARRAY_MAP = 1,		/* LBA -> PBA + 1, 0 = unmapped */
	DD_ARRAY_REFCOUNT = 2,		/* PBA -> number of LBAs mapping it */
	DD_ARRAY_FINGERPRINT = 3,	/* PBA -> fingerprint of its content */
	DD_ARRAY_SAVED = 4,		/* the in-memory state at a clean close */
};

/*
 * The saved in-memory state: an array of __le64 words written at a clean
 * close, named by the superblock that closes (saved_root), so that the
 * next activation loads it instead of walking every tree. It describes
 * exactly that superblock's state; any later commit drops it. Layout, in
 * words: a header of DD_SAVED_HEADER_WORDS, the metadata blocks the trees
 * use (a bitmap), the data blocks with a reference (a bitmap), then the
 * target's own words (the fingerprint index).
 */
#define DD_SAVED_MAGIC		0x3144455641534444ULL	/* "DDSAVED1" */
enum dd_saved_header {
	DD_SAVED_W_MAGIC,
	DD_SAVED_W_TXN,		/* the generation of the superblock naming it */
	DD_SAVED_W_METADATA_BLOCKS,	/* bits in the metadata bitmap */
	DD_SAVED_W_DATA_BLOCKS,		/* bits in the data bitmap */
	DD_SAVED_W_TARGET_WORDS,	/* words after the two bitmaps */
	DD_SAVED_W_TARGET_HEAD = 8,	/* 8 words the target describes */
	DD_SAVED_HEADER_WORDS = 16,
};

#define DD_SAVED_TARGET_HEAD	8

/*
 * Superblock flags. NEEDS_CHECK: the kernel found the metadata damaged;
 * it opens read-only until `dedup check --clear-needs-check` or `dedup
 * repair` clears the flag. UNFLUSHED_APPENDS: the journal's newest
 * append may have been written before the data it points at was
 * flushed (DD_JF_UNFLUSHED); a reader that does not know this must not
 * replay it, so any other bit is refused.
 */
#define DD_SB_NEEDS_CHECK	0x1U
#define DD_SB_UNFLUSHED_APPENDS	0x2U
#define DD_SB_KNOWN_FLAGS	(DD_SB_NEEDS_CHECK | DD_SB_UNFLUSHED_APPENDS)

#define DD_FP_SIZE		32	/* bytes of fingerprint kept per block */
#define DD_HASH_NAME_LEN	32

/*
 * Every metadata block starts with this header. csum is the standard
 * CRC-32C of bytes 4..4095 of the block.
 */
struct dd_block_header {
	__le32 csum;
	__le32 type;
	__le64 blocknr;		/* where the block lives: catches misdirected I/O */
	__le64 txn;		/* transaction that wrote this copy */
	__u8 array;		/* enum dd_array_id; 0 for the superblock */
	__u8 level;		/* 0 = leaf; interior nodes count up to the root */
	__le16 reserved1;
	__le32 reserved2;
} __packed;

#define DD_HEADER_SIZE		32
#define DD_PAYLOAD_SIZE		(DD_BLOCK_SIZE - DD_HEADER_SIZE)
#define DD_INTERIOR_FANOUT	(DD_PAYLOAD_SIZE / sizeof(__le64))	/* 508 */
/* Fingerprint records in one leaf of the fingerprint array. */
#define DD_FP_PER_LEAF		(DD_PAYLOAD_SIZE / DD_FP_SIZE)		/* 127 */

struct dd_superblock {
	struct dd_block_header hdr;	/* hdr.txn is the generation */
	__le64 magic;
	__le32 version;
	__le32 block_size;
	__le64 metadata_blocks;
	__le64 data_blocks;
	__le64 logical_blocks;
	char hash_name[DD_HASH_NAME_LEN];	/* NUL padded */
	__le32 fp_size;			/* digest bytes kept, <= DD_FP_SIZE */
	__le32 flags;
	__le64 map_root;		/* 0 = empty array */
	__le64 refcount_root;
	__le64 fingerprint_root;
	/* space and accounting, all exact as of this commit */
	__le64 mapped_blocks;		/* non-zero map entries == sum(refcount) */
	__le64 used_data_blocks;	/* physical blocks with refcount > 0 */
	__le64 unique_writes;
	__le64 duplicate_writes;
	__le64 zero_writes;
	__le64 discarded_blocks;
	__le64 format_time;		/* seconds since the epoch */
	/*
	 * Added without a format version bump: a reader that ignores them
	 * walks the trees as before, and its first commit drops them.
	 */
	__le64 saved_root;		/* DD_ARRAY_SAVED root, 0 = none */
	__le64 saved_words;		/* its number of words */
	/* Version 2: the journal; all 0 in version 1. */
	__le64 journal_start;		/* first block of its run */
	__le64 journal_blocks;		/* length of the run */
	__le64 journal_seq;		/* the epoch that follows this state */
	__le64 journal_id;		/* random, carried by its blocks */
} __packed;

/*
 * The redo journal (format version 2): a ring of journal_blocks blocks
 * at journal_start. A flush appends the changes made since the last
 * append as records; a checkpoint (a commit of the trees) starts a new
 * epoch. Documentation/dedup-format.rst, "Journal", has the rules.
 */
/*
 * The kernel makes a journal of DD_JOURNAL_BLOCKS, or what the metadata
 * device has room for, at least DD_JOURNAL_MAKE_MIN; it reads any from
 * DD_JOURNAL_MIN_BLOCKS to DD_JOURNAL_BLOCKS long.
 */
#define DD_JOURNAL_BLOCKS	2048
#define DD_JOURNAL_MAKE_MIN	64
#define DD_JOURNAL_MIN_BLOCKS	16
#define DD_JF_END		0x1U	/* the last block of an append */
/* Written while its data was being flushed: replay checks that data. */
#define DD_JF_UNFLUSHED		0x2U

struct dd_journal_header {
	struct dd_block_header hdr;	/* type JRNL, txn informational */
	__le64 journal_id;
	__le64 epoch;			/* the superblock's journal_seq */
	__le64 seq;
	__le32 used;			/* bytes of records after the header */
	__le32 flags;
} __packed;

#define DD_JOURNAL_HEADER_SIZE	64
#define DD_JOURNAL_PAYLOAD	(DD_BLOCK_SIZE - DD_JOURNAL_HEADER_SIZE)

/* A record: a key (type << 56 | index), then the new value. */
enum dd_journal_record {
	DD_JR_MAP = DD_ARRAY_MAP,		/* __le64 PBA + 1 or 0 */
	DD_JR_REFCOUNT = DD_ARRAY_REFCOUNT,	/* __le64, count in the low half */
	DD_JR_FINGERPRINT = DD_ARRAY_FINGERPRINT, /* DD_FP_SIZE bytes */
	DD_JR_COUNTERS = 4,			/* DD_JR_NR_COUNTERS __le64 */
};

#define DD_JR_TYPE_SHIFT	56
#define DD_JR_INDEX_MASK	((1ULL << DD_JR_TYPE_SHIFT) - 1)
/* mapped, used data, unique, duplicate and zero writes, discarded */
#define DD_JR_NR_COUNTERS	6

#endif
