-- skiplock 0010: rate limits per key. A keyed job may carry a rate (key_rate jobs per
-- key_period seconds); admission (sql/keys.py) then admits at most that many of the key's
-- jobs in any such period, logging the admission times of each rate-limited key here (a
-- sliding window, like queues.rate_window). Only the admitter writes this table.

ALTER TABLE jobs ADD COLUMN key_rate integer;
ALTER TABLE jobs ADD COLUMN key_period double precision;
ALTER TABLE jobs ADD CONSTRAINT jobs_key_rate_valid
    CHECK ((key_rate IS NULL) = (key_period IS NULL)
           AND (key_rate IS NULL OR (key_rate >= 1 AND key_period > 0
                                     AND ordering_key IS NOT NULL)));

CREATE TABLE key_rates (
    key        text             PRIMARY KEY,
    period     double precision NOT NULL,
    admissions timestamptz[]    NOT NULL DEFAULT '{}'
);
