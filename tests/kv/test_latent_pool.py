"""The latent pool's page (specpd/kv/latent_pool.py): rows [layer][slot][row_width], target layers then a draft's,
as the wire sees it; tree-path compaction and the transfer placements, which work on any KVPool's `buffer`, move
whole latent rows bit for bit."""
import torch

from specpd.disagg.kv_layout import plan, pool_placements
from specpd.kernels.kv_compact import compact_pool, path_slot_moves
from specpd.kv.latent_pool import LatentKVPool


def filled(num_pages=6, layers=3, extra=1, page_size=4, latent=10, dtype=torch.float32) -> LatentKVPool:
    pool = LatentKVPool(num_pages, layers, page_size, latent, dtype, extra_layers=extra)
    pool.storage.copy_(torch.arange(pool.storage.numel(), dtype=torch.float32).view_as(pool.storage))
    return pool


def test_page_is_layer_slot_row_and_the_draft_layers_follow():
    pool = filled()
    page = pool.storage[2].view(4, 4, 10)  # [target 3 + draft 1 layers, slot, row]
    for layer in range(3):
        assert torch.equal(pool.latent(layer)[2], page[layer])
        # the byte view's two "K / V" halves are the row's halves
        assert torch.equal(pool.buffer[2, layer, 0, :, 0], page[layer, :, :5])
        assert torch.equal(pool.buffer[2, layer, 1, :, 0], page[layer, :, 5:])
    draft = LatentKVPool.layers_of(pool)
    assert draft.latent_dim == 10 and draft.num_layers == 1 and draft.allocator is pool.allocator
    assert torch.equal(draft.latent(0)[2], page[3])
    assert pool.bytes_per_page == 3 * 4 * 10 * 4 and draft.bytes_per_page == 4 * 10 * 4
    assert LatentKVPool(2, 1, 4, 13, torch.float32).row_width == 14  # odd latent widths get one pad element


def test_compaction_moves_whole_rows_of_every_target_layer():
    pool = filled()
    before = pool.storage.clone()
    pages = [4, 1, 5]
    moves = path_slot_moves(pages, committed_len=3, accepted_nodes=[0, 2, 5], page_size=4)
    compact_pool(pool, moves)
    for layer in range(3):
        rows, old = pool.latent(layer), before[:, :].view(6, 4, 4, 10)[:, layer]
        for k, node in enumerate([0, 2, 5]):
            src, dst = 3 + node, 3 + k
            assert torch.equal(rows[pages[dst // 4], dst % 4], old[pages[src // 4], src % 4])
    assert torch.equal(pool.storage.view(6, 4, 4, 10)[:, 3], before.view(6, 4, 4, 10)[:, 3])  # draft rows stay


def test_placements_move_whole_pages_target_and_draft():
    p, d = filled(), filled()
    src = [tuple(pool_placements(p, 0, 0, 0))]
    dst = [tuple(pool_placements(d, 0, 0, 0))]
    assert src[0][0].block_bytes == 4 * 10 * 4  # a layer's rows
    runs = plan(src, dst, range(4))
    assert list(runs) == [(0, 0)] and len(runs[(0, 0)]) == 1 and runs[(0, 0)][0].num_bytes == p.storage[0].numel() * 4
    only_target = plan([tuple(pool_placements(filled(extra=0), 0, 0, 0))], dst, range(3))
    assert only_target[(0, 0)][0].num_bytes == 3 * 4 * 10 * 4  # decode-only: the target's block of D's page
