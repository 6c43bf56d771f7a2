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
 *	with an index part in the target's layout (IDX2, see
 *	Documentation/dedup-format.rst, "Saved state"): one entry for each
 *	live block the workload knows, in a bucket of its own choosing (no
 *	lookup ever runs here), and the rest counted as not indexed
 *	(index_full), so that the index rules hold.
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

struct model {
	u64 nr_contents;
	int64_t *pba_of;	/* content id -> pba holding it, -1 if none */
};

/* dedup-decide.c's index layout, as the target saves it. */
#define INDEX_LAYOUT	0x32584449	/* "IDX2" */
enum {
	HEAD_LAYOUT, HEAD_KEY0, HEAD_KEY1, HEAD_ENTRIES, HEAD_FULL, HEAD_LOADS,
	HEAD_GEOMETRY, HEAD_BUCKETS
};
/* dedup-index.c's sizing */
#define INDEX_BUCKET		8	/* entries per bucket */
#define INDEX_LOAD_PERCENT	95
#define INDEX_MIN_ENTRY_BITS	30
#define INDEX_MIN_TAG_BITS	4
#define INDEX_MAX_LOADS		16

/*
 * The index's shape for a table's data blocks, as dedup-index.c computes
 * it: nr_buckets buckets of INDEX_BUCKET entries of entry_bits bits,
 * packed in nr_words words. An entry's low leaf_bits bits are the
 * fingerprint leaf + 1 (0 = empty), the rest a tag.
 */
struct index_geometry {
	u64 nr_leaves;
	u64 nr_buckets;
	u64 nr_entries;
	u64 nr_words;
	u32 entry_bits;
	u32 leaf_bits;
};

static void index_geometry(u64 data_blocks, struct index_geometry *g)
{
	g->nr_leaves = DIV_ROUND_UP_ULL(data_blocks, DD_FP_PER_LEAF);
	g->leaf_bits = g->nr_leaves ? 64 - __builtin_clzll(g->nr_leaves) : 1;
	g->entry_bits = max_t(u32, INDEX_MIN_ENTRY_BITS,
			      g->leaf_bits + INDEX_MIN_TAG_BITS);
	g->nr_buckets = DIV_ROUND_UP_ULL(data_blocks * 100,
					 INDEX_LOAD_PERCENT * INDEX_BUCKET);
	if (g->nr_buckets < 2)
		g->nr_buckets = 2;
	g->nr_entries = g->nr_buckets * INDEX_BUCKET;
	g->nr_words = DIV_ROUND_UP_ULL(g->nr_entries * g->entry_bits, 64);
}

/* head[6] of a save. */
static u64 index_geometry_word(const struct index_geometry *g)
{
	return g->entry_bits | (u64)g->leaf_bits << 8 |
	       (u64)INDEX_BUCKET << 16 | (u64)DD_FP_PER_LEAF << 32;
}

static u64 entry_mask(const struct index_geometry *g)
{
	return g->entry_bits == 64 ? ~0ULL : (1ULL << g->entry_bits) - 1;
}

/* Entry k: bits [k * w, k * w + w) of the words, maybe two of them. */
static u64 entry_get(const struct index_geometry *g, const u64 *words, u64 k)
{
	u64 bit = k * g->entry_bits, i = bit / 64;
	u32 off = bit % 64;
	u64 v = words[i] >> off;

	if (off + g->entry_bits > 64)
		v |= words[i + 1] << (64 - off);
	return v & entry_mask(g);
}

static void entry_set(const struct index_geometry *g, u64 *words, u64 k,
		      u64 v)
{
	u64 bit = k * g->entry_bits, i = bit / 64, m = entry_mask(g);
	u32 off = bit % 64;

	v &= m;
	words[i] = (words[i] & ~(m << off)) | v << off;
	if (off + g->entry_bits > 64) {
		words[i + 1] = (words[i + 1] & ~(m >> (64 - off))) |
			       v >> (64 - off);
	}
}

static struct dd_md_saved saved = { .head = { INDEX_LAYOUT } };
static struct index_geometry geometry;

/*
 * dd_index_saved_ok without a maximum: the geometry is the table's, every
 * entry names a fingerprint leaf of the device with a block in the data
 * bitmap, and the count agrees.
 */
static int saved_ok(void *ctx, const struct dd_md_saved *s,
		    const struct dd_space *live, const char **why)
{
	const struct index_geometry *g = &geometry;
	u64 n = 0, leaf_mask = (1ULL << g->leaf_bits) - 1;

	(void)ctx;
	if (s->head[HEAD_LOADS] >= INDEX_MAX_LOADS) {
		*why = "loaded too often since the last walk";
		return -EAGAIN;
	}
	if (s->head[HEAD_GEOMETRY] != index_geometry_word(g) ||
	    s->head[HEAD_BUCKETS] != g->nr_buckets) {
		*why = "saved with another index geometry";
		return -ESTALE;
	}
	for (u64 k = 0; k < g->nr_entries; k++) {
		u64 v = entry_get(g, s->words, k), leaf, b, end;

		if (!v)
			continue;
		*why = "an index entry names no fingerprint leaf of the device";
		if (!(v & leaf_mask) || (v & leaf_mask) > g->nr_leaves)
			return -EILSEQ;
		leaf = (v & leaf_mask) - 1;
		b = leaf * DD_FP_PER_LEAF;
		end = b + DD_FP_PER_LEAF < live->nr_blocks ?
		      b + DD_FP_PER_LEAF : live->nr_blocks;
		while (b < end && !dd_space_is_used(live, b))
			b++;
		*why = "an index entry names a leaf without a used block";
		if (b == end)
			return -EILSEQ;
		n++;
	}
	*why = "the index's entry count disagrees";
	return n == s->head[HEAD_ENTRIES] && n <= live->nr_used ? 0 : -EILSEQ;
}

/*
 * The index part of a save: an entry for each live block of the model,
 * in the first bucket with room from one picked from its content.
 */
static void build_index(const struct model *m, struct dd_md_saved *out,
			u64 live)
{
	const struct index_geometry *g = &geometry;
	u64 n = 0;

	out->head[HEAD_KEY0] = 0x0706050403020100ULL;
	out->head[HEAD_KEY1] = 0x0f0e0d0c0b0a0908ULL;
	out->head[HEAD_GEOMETRY] = index_geometry_word(g);
	out->head[HEAD_BUCKETS] = g->nr_buckets;
	for (u64 c = 1; c <= m->nr_contents; c++) {
		u64 h = c * 0x9E3779B97F4A7C15ULL, bucket, pba, k;

		if (m->pba_of[c] < 0)
			continue;
		pba = (u64)m->pba_of[c];
		bucket = (h >> 20) % g->nr_buckets;
		for (u64 tries = 0; tries < g->nr_buckets; tries++) {
			for (k = bucket * INDEX_BUCKET;
			     k < (bucket + 1) * INDEX_BUCKET; k++) {
				if (!entry_get(g, out->words, k))
					break;
			}
			if (k < (bucket + 1) * INDEX_BUCKET) {
				/* leaf + 1, then a tag of the high hash bits */
				entry_set(g, out->words, k,
					  (pba / DD_FP_PER_LEAF + 1) |
					  (h >> 40) << g->leaf_bits);
				n++;
				break;
			}
			bucket = (bucket + 1) % g->nr_buckets;
		}
	}
	out->head[HEAD_ENTRIES] = n;
	out->head[HEAD_FULL] = n < live ? live - n : 0;
}

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

/*
 * A share as the target makes most of them: through the fingerprint leaf
 * the index names, in place when the leaves it changes are fresh.
 */
static int share_known(struct dd_metadata *md, struct model *m, u64 lba,
		       u64 pba, const u8 *fp, struct dd_md_freed *f)
{
	struct dd_md_dup d = {
		.lba = lba, .leaf = pba / (DD_PAYLOAD_SIZE / DD_FP_SIZE),
		.fp = fp, .pba = U64_MAX,
	};
	unsigned int done = 0;

	dd_md_map_duplicates(md, &d, 1, &done, f);
	if (done != 1 || (d.r >= 0 && d.pba != pba)) {
		fprintf(stderr, "share of %llu found %llu (done %u)\n",
			(unsigned long long)pba, (unsigned long long)d.pba, done);
		return -EILSEQ;
	}
	return freed(m, d.r, f);
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
		/* Half each way; no draw, so that the sequence stays the same. */
		if (lba & 1)
			return share_known(md, m, lba, pba, fp, f);
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
	index_geometry(cfg.data_blocks, &geometry);
	saved.nr_words = geometry.nr_words;
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
			build_index(&m, &out, st.data_live);
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
