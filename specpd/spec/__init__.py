"""Speculative decoding: a draft proposes tokens, one target forward verifies them, the request keeps what the
target would have produced anyway (greedy output identical to plain decoding; sampled output from the same
distribution).

The engine runs a round through `SpecRunner.execute` (runner.py), the speculative StepRunner
(specpd/model/runner.py names the interface; plain decoding's is the ModelRunner). One round, per request
in decode:
  0. plan:    policy.py (`AdaptivePolicy.plan`) picks each request's depth and width, 0 being a plain decode
              step, from its acceptance estimates (accept.py) and what rounds cost here (cost.py, timed at
              start by calibration.py).
  1. propose: a drafter in draft/ (`Proposer`: EAGLE-1, EAGLE-3 and MTP over their own paged KV, n-gram,
              hybrid) grows a tree of candidate tokens (tree.py: `TreeBuilder` -> `DraftTree`).
  2. verify:  one target forward covers every tree under a tree attention mask (runner.py); per tree,
              verify/greedy.py (argmax) or verify/rejection.py (lossless rejection sampling; the vocabulary
              accepted / rejected / bonus is defined there) picks the accepted path and one bonus token.
  3. commit / rollback: commit.py (`TreeVerifier._commit`) decides what a request commits: the accepted path
              plus the bonus, with that path's KV moved next to the root. Everything past it is scratch;
              the engine's scheduler (`Scheduler.commit`) advances the committed length and frees whole
              surplus pages, so a rollback is a length change.
  4. observe: the policy learns the round's acceptance (`AdaptivePolicy.observe`, accept.py) and time
              (cost.py); stats.py counts tau (tokens committed per verify forward, `spec_accept_length`); the
              drafter extends over what was committed (`Proposer.extend`), now or, when the request next
              speculates, from the features defer.py keeps.
"""
