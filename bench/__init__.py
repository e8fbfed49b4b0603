"""Benchmarks, run from the repository root as ``python -m bench.<name>``:

  weipipe_vs_1f1b    tokens/s and bytes moved: 1F1B against WeiPipe-Interleave and WeiPipe-ZB
  zb_trace_bubble    planned against measured bubble of weipipe-interleave and weipipe-zb
  fpdt_overhead      FPDT attention's time over plain Ulysses at 1, 2, 4, 8 chunks
  fpdt_memory        a layer's peak memory per attention method; the longest sequence in a budget
  fpdt_packed        FPDT attention on packed short documents against one long sequence
  fpdt_gpu           FPDT on one CUDA device: kernels, overhead, TFLOP/s, longest sequence

and what they share: fpdt_util (the FPDT benchmarks' layers and memory readings),
pinned_rank (a torchrun entry: pretrain_gpt.py with the rank pinned to one core).
The simulator's link testbed and its probes are in tools/simulator_validation/.
"""
