"""What every benchmark under evals/ shares, so that no experiment carries its own copy:

1. `servers`: start `specpd serve` processes and PD clusters (on specpd.server.launch: its port choice and its
   wait for /health), or any other server's command (the peers: vLLM, llama.cpp) in a process group of its own,
   and stop them.
2. `client`: the streaming OpenAI client: one greedy streamed completion timed chunk by chunk, workloads of them,
   their TTFT / TPOT / τ summary.
3. `prompts`: real-text and held-out ShareGPT / HumanEval prompts.
4. `results`: the report writer: write_json records the machine, the CPU ISA, the versions and the commit.
"""
