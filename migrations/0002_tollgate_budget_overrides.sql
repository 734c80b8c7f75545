-- tollgate budget overrides: a money budget's amount (and optionally its period) for one level of
-- one priced domain, without a file edit. Apply with `tollgate quota migrate` (idempotent, with
-- the tenant tables) or with your migration tool; manage rows with `tollgate budget set|get|list|delete`.
--
-- `path` is the level's descriptor entries as tollgate writes them in keys (`org=acme`,
-- `org=acme:team=search`, every key and value percent-escaped: `%`, `{`, `}`, `:`, `=` and control
-- characters). `amount` is a decimal in the price table's currency, read exactly (up to 9
-- decimals); `per` is minute, hour, day, week, month or year, or NULL for the file's period.
-- tollgate validates rows when it reads them and skips (and logs) one it cannot read.
CREATE TABLE IF NOT EXISTS tollgate_budget_overrides (
    domain     text        NOT NULL,
    path       text        NOT NULL,
    amount     text        NOT NULL,
    per        text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (domain, path)
);
