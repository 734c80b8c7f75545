-- tollgate tenant quotas. Apply with `tollgate quota migrate --quota-store URL` (idempotent) or
-- with your migration tool. tollgate reads these tables; it never writes them while serving.
--
-- Quotas are per tenant, not per domain: a tenant's buckets (rl:{tenant}:class) are shared by
-- every domain that names the tenant, so its tier and overrides are too. Tier names refer to
-- the `tiers:` of each domain file; an unknown tier falls back to that domain's default_tier.

CREATE TABLE IF NOT EXISTS tollgate_tenants (
    tenant_id  text        PRIMARY KEY,
    tier       text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- One row per (tenant, class) exception: the bucket this tenant gets for this class, replacing
-- its tier's. Rows past expires_at are ignored. tollgate validates rows when it reads them and
-- skips (and logs) rows with a negative, infinite or NaN capacity or rate.
CREATE TABLE IF NOT EXISTS tollgate_overrides (
    tenant_id         text             NOT NULL,
    class             text             NOT NULL,
    capacity          double precision NOT NULL,
    refill_per_second double precision NOT NULL,
    expires_at        timestamptz,
    updated_at        timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, class)
);
