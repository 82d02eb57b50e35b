"""The OpenAI formats the proxy reads and writes: prefill's answer read as its first token
(:mod:`.prefill_answer`), the two legs joined into one answer (:mod:`.splice`) and which tokens a
decode prompt may end with (:mod:`.token_texts`)."""
