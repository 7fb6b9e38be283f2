"""The prefix cache's radix tree on its own: page-granular matches, lookahead keys, ref counts, LRU eviction."""
import pytest

from specpd.kv.allocator import OutOfPages, PageAllocator
from specpd.kv.radix import RadixCache

PS = 4


def make(num_pages=16, lookahead=0):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, PS, lookahead=lookahead)


def finish(cache, alloc, tokens, pages, valid=None, node=None):
    """What the scheduler does when a request lets go of its pages."""
    rest = cache.insert(tokens, pages, len(tokens) if valid is None else valid)
    cache.unlock(node)
    alloc.free(rest)


def check(alloc, cache):
    assert alloc.num_free + cache.num_evictable == alloc.num_pages


def test_match_at_page_boundaries_and_mid_page():
    alloc, cache = make()
    toks = list(range(10))  # 2 full pages + 2 tokens
    pages = alloc.alloc(3)
    finish(cache, alloc, toks, pages)
    assert cache.num_cached == 2 and alloc.num_free == 14  # the partial third page is freed
    check(alloc, cache)
    assert cache.match(toks).pages == pages[:2]
    assert cache.match(toks[:8]).pages == pages[:2]  # exactly two pages
    assert cache.match(toks[:7]).pages == pages[:1]  # mid-page: only whole pages match
    assert cache.match(toks[:3]).pages == []
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9]).pages == pages[:1]  # diverges inside page 2
    assert cache.match(toks, max_tokens=7).pages == pages[:1]  # the caller keeps its last token


def test_split_shared_prefix_then_divergent_branches():
    alloc, cache = make()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]
    b = [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0]
    pa = alloc.alloc(3)
    finish(cache, alloc, a, pa)
    m = cache.match(b)
    assert m.pages == pa[:2]
    cache.lock(m.node)
    pb = m.pages + alloc.alloc(1)
    finish(cache, alloc, b, pb, node=m.node)
    assert cache.num_cached == 4  # two shared pages, then one branch each
    assert cache.match(a).pages == pa and cache.match(b).pages == pb
    check(alloc, cache)


def test_duplicate_pages_are_returned_to_the_caller():
    alloc, cache = make()
    toks = list(range(8))
    p1, p2 = alloc.alloc(2), alloc.alloc(2)  # two requests computed the same prefix at once
    finish(cache, alloc, toks, p1)
    rest = cache.insert(toks, p2, 8)
    assert rest == p2 and cache.num_cached == 2
    alloc.free(rest)
    check(alloc, cache)


def test_invalid_positions_are_not_cached():
    alloc, cache = make()
    toks = list(range(12))
    pages = alloc.alloc(3)
    finish(cache, alloc, toks, pages, valid=6)  # KV valid below 6: one whole page
    assert cache.num_cached == 1 and cache.match(toks).pages == pages[:1]
    check(alloc, cache)


def test_lookahead_needs_the_token_after_the_page():
    alloc, cache = make(lookahead=1)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 42]
    pages = alloc.alloc(3)
    finish(cache, alloc, a, pages)
    assert cache.num_cached == 2  # page 2 (positions 8..) is partial
    assert cache.match(a).pages == pages[:2]
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0]).pages == pages[:1]  # page 1's next token differs
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).pages == pages[:1]  # no token after page 1 to check
    # a sibling with the same page tokens and another next token holds its own page
    b = [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]
    m = cache.match(b)
    cache.lock(m.node)
    pb = m.pages + alloc.alloc(2)
    finish(cache, alloc, b, pb, node=m.node)
    assert cache.num_cached == 3
    assert cache.match(b).pages == pb[:2] and cache.match(a).pages == pages[:2]
    check(alloc, cache)


def test_nothing_referenced_is_evicted_and_lru_order():
    alloc, cache = make(num_pages=6)
    a, b = [1] * 8, [2] * 8
    pa, pb = alloc.alloc(2), alloc.alloc(2)
    finish(cache, alloc, a, pa)
    finish(cache, alloc, b, pb)
    cache.match(a)  # a is now the most recently used
    held = cache.match(b)
    cache.lock(held.node)
    assert cache.num_evictable == 2
    got = alloc.alloc(4)  # 2 free + a's 2 cached pages; b's are locked
    assert sorted(set(got) & set(pa)) == sorted(pa) and cache.match(b).pages == pb
    with pytest.raises(OutOfPages):
        alloc.alloc(1)
    cache.unlock(held.node)
    assert alloc.can_alloc(2)
    alloc.free(got)
    check(alloc, cache)
    # leaves go first: after a leaf is evicted its parent becomes one
    assert cache.evict(1) == 1 and cache.match(b).pages == pb[:1]
    assert cache.flush() == 1 and alloc.num_free == alloc.num_pages


def test_eviction_prefers_least_recently_used_leaf():
    alloc, cache = make(num_pages=8)
    seqs = [[i] * 4 for i in range(3)]
    pages = [alloc.alloc(1) for _ in seqs]
    for s, p in zip(seqs, pages):
        finish(cache, alloc, s, p)
    cache.match(seqs[0])
    cache.match(seqs[2])
    assert cache.evict(1) == 1
    assert cache.match(seqs[1]).pages == [] and cache.match(seqs[0]).pages == pages[0]


def test_ref_counts_stack_and_unlock_of_unreferenced_raises():
    alloc, cache = make()
    toks = list(range(8))
    finish(cache, alloc, toks, alloc.alloc(2))
    m = cache.match(toks)
    cache.lock(m.node)
    cache.lock(m.node)
    assert cache.num_evictable == 0
    cache.unlock(m.node)
    assert cache.num_evictable == 0 and cache.evict(2) == 0
    cache.unlock(m.node)
    assert cache.num_evictable == 2
    with pytest.raises(ValueError):
        cache.unlock(m.node)


def test_hit_and_query_counters():
    alloc, cache = make()
    toks = list(range(9))
    finish(cache, alloc, toks, alloc.alloc(3))
    cache.match(toks)
    assert cache.stats()["prefix_cache_hit_tokens"] == 8
    assert cache.stats()["prefix_cache_query_tokens"] == 9


def test_scheduler_never_frees_a_matched_page_it_did_not_compute_past():
    """A request that matched cached pages and then lets go with less valid KV than it matched (payloads
    missing, say) frees only its own pages: the matched ones stay in the tree."""
    from specpd.config import SchedulerConfig
    from specpd.core import Request, SamplingParams
    from specpd.engine.scheduler import Scheduler
    alloc, cache = make()
    toks = list(range(12))
    finish(cache, alloc, toks, alloc.alloc(3))
    sched = Scheduler(SchedulerConfig(), alloc, PS, cache=cache)
    req = Request("r", toks + [99, 98], SamplingParams())
    sched.add(req)
    batch = sched.schedule()
    assert batch.items[0].start == 12 and req.num_cached_tokens == 12
    req.num_computed_tokens = 0  # as if nothing it holds were valid
    sched.finish(req, "abort")
    assert cache.num_cached == 3 and cache.match(toks).num_pages == 3
    check(alloc, cache)


def test_payloads_cut_and_cleared_where_the_draft_kv_was_built():
    """A speculating engine's pages carry the features of draft KV never built (None where built): a match cut
    before the first such page keeps its node in step, and a request that offers None for the very page a node
    holds (its draft caught up over it) clears that node's features; a different page for the key changes nothing."""
    alloc, cache = make(lookahead=1)
    toks = list(range(13))  # 3 pages + the lookahead token
    pages = alloc.alloc(3)
    assert cache.insert(toks, pages, 12, [None, "f1", "f2"]) == []
    m = cache.match(toks)
    assert m.payloads == [None, "f1", "f2"]
    built = m.draft_built()
    assert built.pages == pages[:1] and built.payloads == [None] and built.node.depth == 1
    assert m.cut(0).pages == [] and m.cut(0).node is None and m.cut(5) is m
    cache.lock(m.node)
    other = alloc.alloc(1)
    assert cache.insert(toks, [pages[0], other[0], pages[2]], 12, [None, None, None]) == other  # page 2: not its
    cache.unlock(m.node)
    alloc.free(other)
    assert cache.match(toks).payloads == [None, "f1", None]
    check(alloc, cache)
