-- skiplock 0014: jobs claimed ahead. A worker that prefetches claims jobs before it has a
-- slot for them; until it records that a job started, the job is marked claimed ahead,
-- and rescue gives back the attempt of a marked job whose worker died (decision 015).
-- A constant default: no table rewrite.

ALTER TABLE jobs ADD COLUMN claimed_ahead boolean NOT NULL DEFAULT false;
