"""Unified Sequence Parallelism: Ulysses all-to-all x Ring attention, and packed documents.

The attention path reads one way, top to bottom:

* :mod:`.core_attention`  megatron-core's core-attention slot: :class:`USPAttention`.
* :mod:`.attention`       :func:`usp_attention`, the Ulysses x Ring pipeline over head chunks.
* :mod:`.ulysses`         the all-to-alls over the Ulysses group (sequence <-> head sharded).
* :mod:`.ring_attention`  load-balanced (zigzag) ring attention over the Ring group.
* :mod:`.ring_comm`       the point-to-point ring communicator.
* :mod:`.kernels`         local attention kernels and the out/lse merge.
* :mod:`.window_kernel`   sliding-window local attention (flash's own window, or a mask).

The layout and its groups: :mod:`.parallel_dims` (:class:`ParallelDims`, degrees and rank
arithmetic, torch-free), :mod:`.parallel_state` (the live process groups), :mod:`.token_order`
(which positions each rank holds) and :mod:`.backend_names` (kernel names and whether each can
run here, torch-free).

Packed documents: :mod:`.document_mask` (boundaries), :mod:`.document_kernels` (masked local
blocks), :mod:`.document_ring` (the ring that moves only shared blocks),
:mod:`.load_balance` (work over the ring ranks), :mod:`.packed_documents` (a rank that
holds whole documents in order, and the measured cost table) and :mod:`.document_choice`
(``auto``: the cheapest kernel per block by that table). Sliding windows ride on the document
ring: its plan takes the window and sends only the halo of keys the window reaches.
"""
