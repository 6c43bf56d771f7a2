// SPDX-License-Identifier: GPL-2.0-only
/*
 * Drives dm-dedup's real metadata code (dedup-metadata.c and what it uses)
 * in userspace, so the tools' tests can compare with it:
 *
 *   harness open META LOGICAL DATA
 *	dd_md_open(): formats a zeroed device, or activates (all the kernel's
 *	checks); prints a "stats" line. Exit 1 with the error if refused.
 *   harness map META LOGICAL DATA
 *	activates read-only and prints "lba pba" for every mapped block.
 *   harness workload META LOGICAL DATA SEED OPS COMMIT_EVERY [CRASH_OPS]
 *	what the target does for OPS random writes (new, duplicate and zero
 *	blocks) and discards, committing every COMMIT_EVERY operations and at
 *	the end; prints the committed map. With CRASH_OPS, that many more
 *	operations follow whose blocks are written but never committed (a
 *	crash before the superblock write).
 *   harness journal META LOGICAL DATA SEED OPS COMMIT_EVERY APPEND_EVERY TAIL
 *	the workload with a journal append (what a flush does) every
 *	APPEND_EVERY operations between the commits; prints the map as of
 *	the last append, then TAIL more operations are never appended, and
 *	the process "crashes" as in workload: the next open replays.
 *   harness save META LOGICAL DATA SEED OPS COMMIT_EVERY
 *	the workload, then what the target does at a clean close: dd_md_save
 *	with an index part of all-empty slots whose head counts every live
 *	block as not indexed (index_full), so that the index rules hold.
 *
 * Every command opens with cfg.saved set, as the target does: a device
 * whose superblock names a save loads it instead of walking the trees;
 * the stats line says which (loaded=1).
 */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kshim.h"
#include "dedup-metadata.h"

/* dedup-decide.c's index layout, as the target saves it. */
#define INDEX_LAYOUT	0x31584449	/* "IDX1" */
enum { HEAD_LAYOUT, HEAD_KEY0, HEAD_KEY1, HEAD_ENTRIES, HEAD_FULL };

static struct dd_md_saved saved = { .head = { INDEX_LAYOUT } };

/* dd_index_saved_ok without a maximum: the slots and the count agree. */
static int saved_ok(void *ctx, const struct dd_md_saved *s,
		    const struct dd_space *live, const char **why)
{
	u64 n = 0;

	(void)ctx;
	for (u64 i = 0; i < s->nr_words; i++)
		n += !!s->words[i];
	*why = "the index's entry count disagrees";
	return n == s->head[HEAD_ENTRIES] && n <= live->nr_used ? 0 : -EILSEQ;
}

struct model {
	u64 nr_contents;
	int64_t *pba_of;	/* content id -> pba holding it, -1 if none */
};

static void make_fp(u64 c, u8 *fp)
{
	u64 x = c * 0x9E3779B97F4A7C15ULL + 1;

	memcpy(fp, &c, 8);
	for (int i = 8; i < DD_FP_SIZE; i += 8) {
		x ^= x >> 31;
		x *= 0xBF58476D1CE4E5B9ULL;
		memcpy(fp + i, &x, 8);
	}
}

static u64 fp_content(const u8 *fp)
{
	u64 c;

	memcpy(&c, fp, 8);
	return c;
}

static int visit(void *ctx, u64 pba, const u8 *fp)
{
	struct model *m = ctx;
	u64 c = fp_content(fp);

	if (c && c <= m->nr_contents)
		m->pba_of[c] = (int64_t)pba;
	return 0;
}

static void on_free(struct model *m, const struct dd_md_freed *f)
{
	u64 c = fp_content(f->fp);

	if (c && c <= m->nr_contents && m->pba_of[c] == (int64_t)f->pba)
		m->pba_of[c] = -1;
}

/* A verb's result, the block it freed dropped from the model: 1 becomes 0. */
static int freed(struct model *m, int r, const struct dd_md_freed *f)
{
	if (r == 1)
		on_free(m, f);
	return r > 0 ? 0 : r;
}

static u64 rng_state;

static u64 rnd(u64 n)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return n ? rng_state % n : 0;
}

static void print_stats(struct dd_metadata *md)
{
	struct dd_md_stats st;

	dd_md_stats(md, &st);
	printf("stats loaded=%d needs_check=%d replayed=%llu txn=%llu metadata_used=%llu metadata_total=%llu data_used=%llu live=%llu mapped=%llu unique=%llu duplicate=%llu zero=%llu discarded=%llu\n",
	       saved.loaded, dd_md_needs_check(md),
	       (unsigned long long)st.journal_replayed,
	       (unsigned long long)st.transaction_id, (unsigned long long)st.metadata_used,
	       (unsigned long long)st.metadata_total, (unsigned long long)st.data_used,
	       (unsigned long long)st.data_live, (unsigned long long)st.mapped,
	       (unsigned long long)st.unique_writes, (unsigned long long)st.duplicate_writes,
	       (unsigned long long)st.zero_writes, (unsigned long long)st.discarded);
}

static int print_map(struct dd_metadata *md, u64 logical)
{
	for (u64 lba = 0; lba < logical; lba++) {
		u64 pba;
		int r = dd_md_lookup(md, lba, &pba, false);

		if (r == -ENODATA)
			continue;
		if (r) {
			fprintf(stderr, "lookup of %llu failed: %d\n", (unsigned long long)lba, r);
			return r;
		}
		printf("%llu %llu\n", (unsigned long long)lba, (unsigned long long)pba);
	}
	return 0;
}

static int one_op(struct dd_metadata *md, struct model *m, u64 logical)
{
	u64 lba = rnd(logical), pba, left;
	struct dd_md_freed f[4];
	unsigned int nr;
	u8 fp[DD_FP_SIZE];
	int r;

	if (rnd(100) < 3) {
		u64 end = lba + 1 + rnd(rnd(8) ? 16 : 1200), n = 0;

		if (end > logical)
			end = logical;
		do {
			r = dd_md_unmap_range(md, lba, end, f, 4, &nr, &lba, &n);
			for (unsigned int i = 0; i < nr; i++)
				on_free(m, &f[i]);
		} while (!r && lba < end);
		return r;
	}
	u64 c = rnd(100) < 10 ? 0 : 1 + rnd(m->nr_contents);

	if (!c)
		return freed(m, dd_md_map_zero(md, lba, f), f);
	make_fp(c, fp);
	if (m->pba_of[c] >= 0) {
		pba = (u64)m->pba_of[c];
		return freed(m, dd_md_map_duplicate(md, lba, pba, fp, f), f);
	}
	r = dd_md_alloc_data(md, &pba, &left);
	/* A freed block is reusable after the second commit. */
	for (int i = 0; i < 2 && r == -EAGAIN; i++) {
		r = dd_md_commit(md, NULL, NULL);
		if (!r)
			r = dd_md_alloc_data(md, &pba, &left);
	}
	if (r == -ENOSPC)
		return 0;	/* the target fails the write; nothing changes */
	if (r)
		return r;
	r = freed(m, dd_md_map_new(md, lba, pba, fp, f), f);
	if (!r)
		m->pba_of[c] = (int64_t)pba;
	return r;
}

/* What a flush does: the changes since the last append, to the journal. */
static int append_changes(struct dd_metadata *md)
{
	struct dd_journal_batch b;
	int r = dd_md_journal_take(md, &b);

	if (r == -ENODATA)
		return 0;
	if (r == -ENOSPC)
		return dd_md_commit(md, NULL, NULL);
	return r ? r : dd_md_journal_write(md, &b);
}

int main(int argc, char **argv)
{
	struct dd_md_config cfg = { .hash_name = "sha256", .fp_size = 32 };
	struct model m = { 0 };
	struct block_device bdev;
	struct dd_metadata *md;
	struct stat sb;
	char *error = "";
	const char *cmd;
	int r;

	if (argc < 5) {
		fprintf(stderr, "usage: harness open|map|flag|workload|save|journal META LOGICAL DATA [SEED OPS COMMIT_EVERY [CRASH_OPS | APPEND_EVERY TAIL]]\n");
		return 2;
	}
	cmd = argv[1];
	cfg.logical_blocks = strtoull(argv[3], NULL, 10);
	cfg.data_blocks = strtoull(argv[4], NULL, 10);
	cfg.read_only = !strcmp(cmd, "map");
	bdev.fd = open(argv[2], cfg.read_only ? O_RDONLY : O_RDWR);
	if (bdev.fd < 0 || fstat(bdev.fd, &sb)) {
		perror(argv[2]);
		return 2;
	}
	bdev.bytes = (u64)sb.st_size;
	/* Fewer contents than data blocks: plenty of duplicates. */
	m.nr_contents = cfg.data_blocks / 2 + 1;
	m.pba_of = malloc((m.nr_contents + 1) * sizeof(*m.pba_of));
	for (u64 i = 0; i <= m.nr_contents; i++)
		m.pba_of[i] = -1;
	cfg.visit = visit;
	cfg.ctx = &m;
	/* The target's index size for these many data blocks. */
	saved.nr_words = cfg.data_blocks + cfg.data_blocks / 4 + 16;
	saved.words = calloc(saved.nr_words, sizeof(u64));
	cfg.saved = &saved;
	cfg.saved_ok = saved_ok;

	r = dd_md_open(&bdev, &cfg, &md, &error);
	if (r) {
		printf("refused %d %s\n", r, error);
		return 1;
	}
	if (!strcmp(cmd, "open")) {
		print_stats(md);
	} else if (!strcmp(cmd, "flag")) {
		/* what the target does when it finds damage while running */
		r = dd_md_flag_needs_check(md);
		if (r == 1)
			r = 0;		/* the flag is on disk */
		else if (!r)
			r = -EROFS;	/* nothing written */
		print_stats(md);
	} else if (!strcmp(cmd, "map")) {
		r = print_map(md, cfg.logical_blocks);
		print_stats(md);
	} else if (!strcmp(cmd, "journal") && argc >= 10) {
		u64 ops = strtoull(argv[6], NULL, 10);
		u64 every = strtoull(argv[7], NULL, 10);
		u64 append = strtoull(argv[8], NULL, 10);
		u64 tail = strtoull(argv[9], NULL, 10);

		rng_state = strtoull(argv[5], NULL, 10) * 2654435761ULL + 88172645463325252ULL;
		for (u64 i = 0; i < ops && !r; i++) {
			r = one_op(md, &m, cfg.logical_blocks);
			if (!r && every && (i + 1) % every == 0)
				r = dd_md_commit(md, NULL, NULL);
			else if (!r && append && (i + 1) % append == 0)
				r = append_changes(md);
		}
		if (!r)
			r = append_changes(md);
		if (!r)
			r = print_map(md, cfg.logical_blocks);
		if (!r)
			print_stats(md);
		for (u64 i = 0; i < tail && !r; i++)
			r = one_op(md, &m, cfg.logical_blocks);
		if (!r)
			r = dm_bufio_write_dirty_buffers(**(struct dm_bufio_client ***)md);
	} else if ((!strcmp(cmd, "workload") || !strcmp(cmd, "save")) && argc >= 8) {
		u64 ops = strtoull(argv[6], NULL, 10);
		u64 every = strtoull(argv[7], NULL, 10);
		u64 crash = argc > 8 ? strtoull(argv[8], NULL, 10) : 0;

		rng_state = strtoull(argv[5], NULL, 10) * 2654435761ULL + 88172645463325252ULL;
		for (u64 i = 0; i < ops && !r; i++) {
			r = one_op(md, &m, cfg.logical_blocks);
			if (!r && every && (i + 1) % every == 0)
				r = dd_md_commit(md, NULL, NULL);
		}
		if (!r)
			r = dd_md_commit(md, NULL, NULL);
		if (!r)
			r = print_map(md, cfg.logical_blocks);
		if (!r)
			print_stats(md);
		for (u64 i = 0; i < crash && !r; i++)
			r = one_op(md, &m, cfg.logical_blocks);
		/*
		 * The crash: the running transaction's blocks reach the disk
		 * (dm-bufio may write them back at any time), the superblock
		 * never does. struct dd_metadata starts with its struct dd_bm
		 * pointer, which starts with the dm-bufio client.
		 */
		if (!r && crash)
			r = dm_bufio_write_dirty_buffers(**(struct dm_bufio_client ***)md);
		if (!r && !strcmp(cmd, "save")) {
			struct dd_md_stats st;
			struct dd_md_saved out = { .head = { INDEX_LAYOUT } };

			dd_md_stats(md, &st);
			out.words = calloc(saved.nr_words, sizeof(u64));
			out.nr_words = saved.nr_words;
			out.head[HEAD_FULL] = st.data_live;
			r = dd_md_save(md, &out);
			free(out.words);
			if (!r)
				print_stats(md);
		}
	} else {
		fprintf(stderr, "unknown command %s\n", cmd);
		r = 2;
	}
	if (r)
		fprintf(stderr, "%s failed: %d\n", cmd, r);
	dd_md_close(md);
	free(m.pba_of);
	free(saved.words);
	close(bdev.fd);
	return r ? 1 : 0;
}
