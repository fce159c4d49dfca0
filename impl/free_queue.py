"""The free queue: an intrusive doubly linked list of blocks between two sentinels.

The list threads through the blocks' own ``prev_free_block`` /
``next_free_block`` fields, so no node objects exist and no operation
allocates. Two sentinel blocks (id -1) bracket the list: every real block in
it always has a real neighbour on both sides, which removes the empty-list
branches from removal and insertion. The queue's own methods set both link
fields of a block they take out to None; the pool's hot paths skip that and
leave a held block's links stale (the pool never reads them: a block is in
the queue exactly when its ref_cnt is 0).

    fake_head <-> b1 <-> b2 <-> ... <-> bk <-> fake_tail
    (front: handed out first)          (back: handed out last)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvpool.impl.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order; the front is handed out first.

    >>> blocks = [KVCacheBlock(i) for i in range(3)]
    >>> q = FreeKVCacheBlockQueue(blocks)
    >>> q.remove(blocks[1]); [b.block_id for b in q.get_all_free_blocks()]
    [0, 2]
    """

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        head = KVCacheBlock(-1)
        tail = KVCacheBlock(-1)
        self.fake_free_list_head = head
        self.fake_free_list_tail = tail
        self.num_free_blocks = len(blocks)
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back. Complexity: O(number of free blocks)."""
        node = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while node is not None and node is not tail:
            yield node
            node = node.next_free_block

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the front block.

        Complexity: O(1).

        >>> q = FreeKVCacheBlockQueue([KVCacheBlock(5)])
        >>> q.popleft().block_id, q.num_free_blocks
        (5, 0)
        """
        if self.num_free_blocks == 0:
            raise ValueError("the free queue is empty")
        first = self.fake_free_list_head.next_free_block
        assert first is not None
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the ``n`` front blocks, front first.

        Complexity: O(n).

        >>> q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(4)])
        >>> [b.block_id for b in q.popleft_n(3)], q.num_free_blocks
        ([0, 1, 2], 1)
        """
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"cannot pop {n} of {self.num_free_blocks} free blocks")
        head = self.fake_free_list_head
        out: list[KVCacheBlock] = []
        node = head.next_free_block
        for _ in range(n):
            assert node is not None
            out.append(node)
            nxt = node.next_free_block
            node.prev_free_block = node.next_free_block = None
            node = nxt
        assert node is not None
        head.next_free_block = node
        node.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it stands in the list.

        Complexity: O(1).

        >>> q = FreeKVCacheBlockQueue([KVCacheBlock(1), KVCacheBlock(2)])
        >>> q.remove(q.fake_free_list_head.next_free_block); len(q)
        1
        """
        prev = block.prev_free_block
        nxt = block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of a block that is not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the back.

        Complexity: O(1).

        >>> q = FreeKVCacheBlockQueue([]); q.append(KVCacheBlock(7)); len(q)
        1
        """
        self.append_n((block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` at the back, keeping their order.

        Complexity: O(len(blocks)).

        >>> q = FreeKVCacheBlockQueue([KVCacheBlock(1)])
        >>> q.append_n([KVCacheBlock(2), KVCacheBlock(3)])
        >>> [b.block_id for b in q]
        [1, 2, 3]
        """
        if not blocks:
            return
        tail = self.fake_free_list_tail
        prev = tail.prev_free_block
        assert prev is not None
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` at the front, keeping their order (the first one becomes the front).

        Complexity: O(len(blocks)).

        >>> q = FreeKVCacheBlockQueue([KVCacheBlock(1)])
        >>> q.prepend_n([KVCacheBlock(2), KVCacheBlock(3)])
        >>> [b.block_id for b in q]
        [2, 3, 1]
        """
        if not blocks:
            return
        prev = self.fake_free_list_head
        first = prev.next_free_block
        assert first is not None
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front to back.

        Complexity: O(number of free blocks).

        >>> FreeKVCacheBlockQueue([KVCacheBlock(4)]).get_all_free_blocks()[0].block_id
        4
        """
        return list(self)
