-- skiplock 0033: a cron schedule's description (0030) also names the tags of the job it
-- enqueues (0032), so that `cron run-now` without the App enqueues the job a tick would,
-- tags included. NULL: no tags (and a row described before this migration).
ALTER TABLE periodic ADD COLUMN tags text[];
