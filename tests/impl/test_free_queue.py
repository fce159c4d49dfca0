"""FreeKVCacheBlockQueue and KVCacheBlock on their own."""

import pytest

from kvpool.impl import FreeKVCacheBlockQueue, KVCacheBlock


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def assert_linked(queue: FreeKVCacheBlockQueue) -> None:
    """Both directions give the same sequence and the count matches."""
    forward = queue.get_all_free_blocks()
    backward = []
    node = queue.fake_free_list_tail.prev_free_block
    while node is not None and node is not queue.fake_free_list_head:
        backward.append(node)
        node = node.prev_free_block
    assert forward == backward[::-1]
    assert len(forward) == queue.num_free_blocks == len(queue)


def test_a_new_queue_holds_the_blocks_in_order_between_two_sentinels() -> None:
    blocks, queue = make(4)
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.fake_free_list_head.block_id == queue.fake_free_list_tail.block_id == -1
    assert blocks[0].prev_free_block is queue.fake_free_list_head
    assert blocks[3].next_free_block is queue.fake_free_list_tail
    assert_linked(queue)


def test_an_empty_queue_links_head_to_tail() -> None:
    _, queue = make(0)
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        queue.popleft()


def test_popleft_and_popleft_n_take_from_the_front_and_clear_links() -> None:
    blocks, queue = make(5)
    assert queue.popleft() is blocks[0]
    taken = queue.popleft_n(2)
    assert taken == blocks[1:3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in taken)
    assert ids(queue) == [3, 4]
    assert queue.popleft_n(0) == []
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert_linked(queue)


def test_remove_unlinks_from_anywhere_and_rejects_an_unlinked_block() -> None:
    blocks, queue = make(5)
    for i in (2, 0, 4):
        queue.remove(blocks[i])
    assert ids(queue) == [1, 3]
    with pytest.raises(RuntimeError):
        queue.remove(blocks[2])
    assert_linked(queue)


def test_append_append_n_and_prepend_n_keep_the_given_order() -> None:
    blocks, queue = make(2)
    extra = [KVCacheBlock(i) for i in range(2, 7)]
    queue.append(extra[0])
    queue.append_n(extra[1:3])
    queue.prepend_n(extra[3:5])
    assert ids(queue) == [5, 6, 0, 1, 2, 3, 4]
    queue.append_n([])
    queue.prepend_n([])
    assert_linked(queue)
    for block in list(queue):
        queue.remove(block)
    queue.prepend_n(blocks)
    assert ids(queue) == [0, 1]
    assert_linked(queue)


def test_block_fields_and_reset_hash() -> None:
    block = KVCacheBlock(7)
    assert (block.block_id, block.ref_cnt, block.is_null, block.pool) == (7, 0, False, None)
    block._hash, block._block_hash_num_tokens = b"h", 16
    block._extra_keys = [(b"p", 1)]
    assert block.block_hash == (b"h", 0) and block.block_hash_num_tokens == 16
    assert "block_id=7" in repr(block)
    block.reset_hash()
    assert block.block_hash is None and block.block_hash_num_tokens is None
    assert block._extra_keys is None
    with pytest.raises(AttributeError):
        block.unknown_field = 1  # type: ignore[attr-defined,unused-ignore]
