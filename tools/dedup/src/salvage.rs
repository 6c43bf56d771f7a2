//! Reading damaged metadata for `repair`: choosing a superblock to trust
//! and walking the three arrays so that every intact leaf is delivered and
//! every part that cannot be trusted is named, by entry range and cause.
//!
//! Unlike `check`, which reports the first reference to a block as good
//! and the second as the problem, the walk here never guesses: a block
//! that two places of the trees claim with the same array and level is
//! dropped from both, because nothing in the block says which place it
//! belongs to. To know that before delivering anything, the interior
//! nodes are walked twice (they are 1/508 of the tree); leaves are read
//! once.

use std::collections::HashMap;

use crate::check::{superblock_rules, Fatal, Severity};
use crate::device::BlockDev;
use crate::ondisk::*;

/// Part of an array that is not salvaged: entries [first, end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    pub array: ArrayId,
    pub first: u64,
    pub end: u64,
    /// Metadata block at fault (for a bad pointer: the block pointed at).
    pub block: u64,
    /// Level of the tree position the block was expected at.
    pub level: u8,
    pub reason: String,
}

impl Lost {
    /// "map leaf at metadata block 77" style description of the node.
    pub fn node(&self) -> String {
        let kind = if self.level == 0 {
            format!("{} leaf", self.array.name())
        } else {
            format!("{} interior node (level {})", self.array.name(), self.level)
        };
        format!("{kind} at metadata block {}", self.block)
    }
}

/// Something found that the rewrite drops without losing entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oddity {
    pub array: ArrayId,
    pub block: u64,
    pub message: String,
}

/// Why `sb` cannot describe the device: what dd_check_sb() and
/// dd_md_open() would refuse (a generation above MAX_TXN included: the
/// repaired superblock could not be newer than it), or sizes the trees
/// cannot be walked with. Counter errors are not listed: repair recomputes
/// the counters.
/// Journal fields dd_check_sb() refuses are not listed either: the trees
/// and sizes are still good, and repair writes a new journal run.
pub fn unusable(sb: &Superblock, dev_blocks: u64) -> Option<String> {
    if sb.version != FORMAT_VERSION && sb.version != FORMAT_VERSION_V1 {
        return Some(format!(
            "format version {} is not supported (this tool knows versions {FORMAT_VERSION_V1} \
             and {FORMAT_VERSION})",
            sb.version
        ));
    }
    if let Some((_, _, msg)) = superblock_rules(sb).into_iter().find(|(sev, code, _)| {
        *sev == Severity::Error && (*code == "superblock" || *code == "txn_too_large")
    }) {
        return Some(msg);
    }
    if sb.metadata_blocks < FIRST_TREE_BLOCK {
        return Some(format!("metadata_blocks is {}", sb.metadata_blocks));
    }
    if sb.metadata_blocks > dev_blocks {
        return Some(format!(
            "it says {} metadata blocks but the device has {dev_blocks} (truncated?)",
            sb.metadata_blocks
        ));
    }
    None
}

/// Where the superblock that repair starts from came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The slot the kernel would use.
    Newest,
    /// A valid slot older than another valid one whose fields are
    /// impossible.
    Fallback { skipped_slot: u64, why: String },
    /// No slot is valid: this one has the magic but fails its checksum,
    /// type or block number test, and its fields and roots look right.
    Damaged { why: String },
}

#[derive(Clone, Debug)]
pub struct Chosen {
    pub sb: Superblock,
    pub slot: u64,
    pub source: Source,
    /// Highest generation among the valid slots (and the chosen one), not
    /// counting those above MAX_TXN: a new superblock must be newer than
    /// all of them to be used. A slot above MAX_TXN is never the chosen
    /// one, so it is the slot the new superblock replaces.
    pub max_generation: u64,
    /// Slots other than the chosen one that are damaged, with why.
    pub other_bad: Vec<(u64, String)>,
}

/// The root of array `id` in `sb` points at a block that is that root.
fn root_plausible(dev: &dyn BlockDev, sb: &Superblock, id: ArrayId) -> bool {
    let root = sb.root(id);
    let g = sb.geometry(id);
    if root == 0 {
        return true;
    }
    if g.nr_entries == 0 || root < FIRST_TREE_BLOCK || root >= sb.metadata_blocks {
        return false;
    }
    let mut b = zero_block();
    if dev.read_block(root, &mut b).is_err() || tree_block_fault(&b, root, id, g.height).is_some() {
        return false;
    }
    let txn = Header::decode(&b[..]).txn;
    txn != 0 && txn <= sb.generation()
}

/// Choose the superblock to salvage from, or say why nothing can be.
pub fn choose_superblock(dev: &dyn BlockDev) -> Result<Chosen, Fatal> {
    let dev_blocks = dev.nr_blocks();
    let states = crate::check::read_slots(dev);
    let mut valid: Vec<(u64, Superblock)> = states
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            SlotState::Valid(sb) => Some((i as u64, (**sb).clone())),
            _ => None,
        })
        .collect();
    // Newest first; on a tie the lower slot, as the kernel.
    valid.sort_by(|a, b| b.1.generation().cmp(&a.1.generation()).then(a.0.cmp(&b.0)));
    let bad = |except: u64| -> Vec<(u64, String)> {
        states
            .iter()
            .enumerate()
            .filter(|(i, _)| *i as u64 != except)
            .filter_map(|(i, s)| match s {
                SlotState::Bad(r) => Some((i as u64, r.clone())),
                _ => None,
            })
            .collect()
    };
    let max_generation = valid
        .iter()
        .map(|v| v.1.generation())
        .filter(|&g| g <= MAX_TXN)
        .max()
        .unwrap_or(0);
    let mut refused: Vec<String> = Vec::new();
    for (k, (slot, sb)) in valid.iter().enumerate() {
        match unusable(sb, dev_blocks) {
            None => {
                let source = if k == 0 {
                    Source::Newest
                } else {
                    Source::Fallback {
                        skipped_slot: valid[0].0,
                        why: refused.join("; "),
                    }
                };
                return Ok(Chosen {
                    sb: sb.clone(),
                    slot: *slot,
                    source,
                    max_generation,
                    other_bad: bad(*slot),
                });
            }
            Some(why) => refused.push(format!(
                "slot {slot} (generation {}): {why}",
                sb.generation()
            )),
        }
    }
    // No valid slot can be used: try the damaged ones that carry the
    // magic, newest first. Their fields are trusted only if the roots
    // they name are the right kind of block, of an older transaction.
    let mut damaged: Vec<(u64, Superblock, String)> = Vec::new();
    for (i, st) in states.iter().enumerate() {
        let SlotState::Bad(why) = st else { continue };
        let mut b = zero_block();
        if dev.read_block(i as u64, &mut b).is_err() {
            continue;
        }
        let sb = Superblock::decode(&b);
        if sb.magic != SB_MAGIC {
            continue;
        }
        match unusable(&sb, dev_blocks) {
            Some(r) => refused.push(format!("slot {i} ({why}): {r}")),
            None if open_blocks(sb.logical_blocks, sb.data_blocks) > dev_blocks => refused
                .push(format!(
                    "slot {i} ({why}): its sizes do not fit the device, they are not trusted"
                )),
            None if !ArrayId::ALL.iter().all(|&id| root_plausible(dev, &sb, id)) => {
                refused.push(format!(
                    "slot {i} ({why}): its roots do not lead to intact trees, its fields are not trusted"
                ))
            }
            None => damaged.push((i as u64, sb, why.clone())),
        }
    }
    damaged.sort_by_key(|d| std::cmp::Reverse(d.1.generation()));
    if let Some((slot, sb, why)) = damaged.into_iter().next() {
        let max_generation = max_generation.max(sb.generation());
        return Ok(Chosen {
            source: Source::Damaged { why },
            max_generation,
            other_bad: bad(slot),
            sb,
            slot,
        });
    }
    if refused.is_empty() {
        return Err(Fatal(
            "no superblock to start from: neither slot holds dm-dedup metadata".into(),
        ));
    }
    // A valid slot above MAX_TXN still describes its trees, but a repaired
    // superblock cannot be newer than it. `dedup dump --force` reads its
    // state, `dedup restore --generation N` writes it with a valid one.
    if valid.iter().any(|v| v.1.generation() > MAX_TXN) {
        return Err(Fatal(format!(
            "no usable superblock: {}; repair cannot write a generation the kernel would prefer \
             to one above the limit. To keep its state: `dedup dump --force DEV -o FILE`, then \
             `dedup restore --force --generation N FILE DEV` with N <= {MAX_TXN}",
            refused.join("; ")
        )));
    }
    Err(Fatal(format!(
        "no usable superblock, so the sizes of the arrays are unknown and nothing can be salvaged: {}",
        refused.join("; ")
    )))
}

/// One array's leaf, delivered to the visitor: leaf number, block number,
/// the block.
pub type LeafVisitor<'v> = dyn FnMut(u64, u64, &Block) + 'v;

/// Packed (array, level) of a claim on a block; 0 = none.
fn claim(id: ArrayId, level: u8) -> u16 {
    (id as u16) << 8 | level as u16
}

pub struct Salvager<'a> {
    dev: &'a dyn BlockDev,
    sb: &'a Superblock,
    /// References to each metadata block from the trees (saturating).
    refs: Vec<u8>,
    /// The first claim on each block, and the later ones of blocks
    /// claimed more than once.
    first_claim: Vec<u16>,
    more_claims: HashMap<u64, Vec<u16>>,
    /// Interior nodes whose children were counted.
    expanded: Vec<bool>,
    pub lost: Vec<Lost>,
    pub oddities: Vec<Oddity>,
}

impl<'a> Salvager<'a> {
    /// Count every reference of the three trees, so that the walks know
    /// which blocks are claimed more than once.
    pub fn new(dev: &'a dyn BlockDev, sb: &'a Superblock) -> Salvager<'a> {
        let n = sb.metadata_blocks as usize;
        let mut s = Salvager {
            dev,
            sb,
            refs: vec![0; n],
            first_claim: vec![0; n],
            more_claims: HashMap::new(),
            expanded: vec![false; n],
            lost: Vec::new(),
            oddities: Vec::new(),
        };
        for id in ArrayId::ALL {
            let g = sb.geometry(id);
            let root = sb.root(id);
            if root != 0 && g.nr_entries > 0 {
                s.count(&g, root, g.height, 0);
            }
        }
        s
    }

    /// Blocks any pointer of the trees names: the committed state, which
    /// must not be overwritten before the new superblock is in place.
    pub fn in_use(&self) -> Vec<bool> {
        self.refs.iter().map(|&r| r > 0).collect()
    }

    fn in_range(&self, b: u64) -> bool {
        b >= FIRST_TREE_BLOCK && b < self.sb.metadata_blocks
    }

    /// Read `b` and judge it as the node (id, level): None if intact.
    fn read_node(&self, b: u64, id: ArrayId, level: u8) -> Result<Box<Block>, String> {
        let mut blk = zero_block();
        self.dev
            .read_block(b, &mut blk)
            .map_err(|e| format!("cannot read: {e}"))?;
        if let Some((_, why)) = tree_block_fault(&blk, b, id, level) {
            return Err(why);
        }
        let txn = Header::decode(&blk[..]).txn;
        let gen = self.sb.generation();
        if txn == 0 || txn > gen {
            return Err(format!(
                "written by transaction {txn}, not by one of 1..={gen}: not part of the committed state"
            ));
        }
        Ok(blk)
    }

    fn count(&mut self, g: &Geometry, b: u64, level: u8, leaf_base: u64) {
        if !self.in_range(b) {
            return;
        }
        let i = b as usize;
        let c = claim(g.id, level);
        self.refs[i] = self.refs[i].saturating_add(1);
        if self.first_claim[i] == 0 {
            self.first_claim[i] = c;
        } else {
            self.more_claims.entry(b).or_default().push(c);
        }
        if level == 0 || self.expanded[i] {
            return;
        }
        let Ok(blk) = self.read_node(b, g.id, level) else {
            return;
        };
        self.expanded[i] = true;
        for slot in 0..INTERIOR_FANOUT as u32 {
            let child = le64(&blk[..], HEADER_SIZE + slot as usize * 8);
            if child == 0 {
                continue;
            }
            if let Some(first_leaf) = g.child_first_leaf(leaf_base, level, slot) {
                self.count(g, child, level - 1, first_leaf);
            }
        }
    }

    /// Claims on `b` with the same array and level as (id, level).
    fn same_claims(&self, b: u64, id: ArrayId, level: u8) -> usize {
        let c = claim(id, level);
        let first = (self.first_claim[b as usize] == c) as usize;
        first
            + self
                .more_claims
                .get(&b)
                .map_or(0, |v| v.iter().filter(|&&x| x == c).count())
    }

    /// Deliver every intact leaf of array `id`, in index order, and record
    /// what is lost.
    pub fn walk(&mut self, id: ArrayId, visit: &mut LeafVisitor<'_>) {
        let g = self.sb.geometry(id);
        let root = self.sb.root(id);
        if root == 0 {
            return;
        }
        if g.nr_entries == 0 {
            self.oddities.push(Oddity {
                array: id,
                block: root,
                message: format!(
                    "the {} array has no entries but its root is block {root}: dropped",
                    id.name()
                ),
            });
            return;
        }
        self.visit(&g, root, g.height, 0, visit);
    }

    fn lose(&mut self, g: &Geometry, b: u64, level: u8, leaf_base: u64, reason: String) {
        let (first, end) = g.entry_range(leaf_base, level);
        if first < end {
            self.lost.push(Lost {
                array: g.id,
                first,
                end,
                block: b,
                level,
                reason,
            });
        }
    }

    fn visit(
        &mut self,
        g: &Geometry,
        b: u64,
        level: u8,
        leaf_base: u64,
        visit: &mut LeafVisitor<'_>,
    ) {
        let id = g.id;
        if !self.in_range(b) {
            let why = format!(
                "the pointer to it is outside the tree area [{FIRST_TREE_BLOCK}, {})",
                self.sb.metadata_blocks
            );
            return self.lose(g, b, level, leaf_base, why);
        }
        let blk = match self.read_node(b, id, level) {
            Ok(blk) => blk,
            Err(why) => return self.lose(g, b, level, leaf_base, why),
        };
        let n = self.same_claims(b, id, level);
        if n > 1 {
            let why = format!(
                "{n} places of the {} tree at level {level} point at it; nothing tells which one is right",
                id.name()
            );
            return self.lose(g, b, level, leaf_base, why);
        }
        let h = Header::decode(&blk[..]);
        if h.reserved1 != 0 || h.reserved2 != 0 {
            self.oddities.push(Oddity {
                array: id,
                block: b,
                message: format!(
                    "reserved header fields of block {b} are not zero ({:#06x}, {:#010x}): written as zero",
                    h.reserved1, h.reserved2
                ),
            });
        }
        if level == 0 {
            let count = g.leaf_count(leaf_base) as usize;
            let used = HEADER_SIZE + count * g.entry_size as usize;
            if !is_zero(&blk[used..]) {
                self.oddities.push(Oddity {
                    array: id,
                    block: b,
                    message: format!(
                        "{} leaf at metadata block {b}: bytes past the end of the array are not zero: written as zero",
                        id.name()
                    ),
                });
            }
            visit(leaf_base, b, &blk);
            return;
        }
        for slot in 0..INTERIOR_FANOUT as u32 {
            let child = le64(&blk[..], HEADER_SIZE + slot as usize * 8);
            if child == 0 {
                continue;
            }
            match g.child_first_leaf(leaf_base, level, slot) {
                None => self.oddities.push(Oddity {
                    array: id,
                    block: b,
                    message: format!(
                        "{} interior node at metadata block {b}: child {slot} (block {child}) lies beyond the end of the array: dropped",
                        id.name()
                    ),
                }),
                Some(first_leaf) => self.visit(g, child, level - 1, first_leaf, visit),
            }
        }
    }
}
