"""Candidate sources: where draft tokens come from. Each proposes weighted continuations of a
request's context (``base.CandidateSource``); a method votes its sources' candidates in one trie
(``drafting.trie.TrieDrafter``)."""
