//! Budget overrides in PostgreSQL, beside tenant quotas: one row per (priced domain, level path)
//! with the amount, and optionally the period, that replace the domain file's for that level
//! (`migrations/0002_tollgate_budget_overrides.sql`).
//!
//! A level is named by its path text ([`crate::identity::path_text`]: `org=acme:team=search`),
//! the same text for the same entries wherever it is computed, so an operator's `tollgate budget
//! set` and a request's lookup meet on one row. Rows are read through the same cache as tenant
//! records ([`super::cache`]: TTL, single flight, failures keep what is known), and validated on
//! read: a row whose amount or period cannot be read is skipped, logged and counted.

use super::postgres::{db, PostgresQuotas, QuotaError};
use crate::budget::{BudgetOverride, Money, Per};

/// One `tollgate_budget_overrides` row, for listing.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetRow {
    /// The priced domain.
    pub domain: String,
    /// The level's path text.
    pub path: String,
    /// The amount as stored.
    pub amount: String,
    /// The period as stored (`None`: the file's).
    pub per: Option<String>,
}

impl PostgresQuotas {
    /// The override of the level `path` of `domain`; `None` when there is none or its row
    /// cannot be read (skipped, logged, counted).
    pub async fn fetch_budget(&self, domain: &str, path: &str) -> Result<Option<BudgetOverride>, QuotaError> {
        metrics::counter!("tollgate_quota_db_queries_total").increment(1);
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT amount, per FROM tollgate_budget_overrides WHERE domain = $1 AND path = $2",
            )
            .await
            .map_err(db)?;
        let Some(row) = client.query_opt(&statement, &[&domain, &path]).await.map_err(db)? else {
            return Ok(None);
        };
        let (amount, per): (String, Option<String>) = (row.get(0), row.get(1));
        match parse(&amount, per.as_deref()) {
            Ok(found) => Ok(Some(found)),
            Err(problem) => {
                metrics::counter!("tollgate_quota_bad_rows_total").increment(1);
                tracing::warn!(domain, path, amount, per, %problem, "skipping invalid row in tollgate_budget_overrides");
                Ok(None)
            }
        }
    }

    /// Sets the amount (and period, or the file's with `None`) of the level `path` of `domain`.
    pub async fn set_budget(
        &self,
        domain: &str,
        path: &str,
        amount: &str,
        per: Option<&str>,
    ) -> Result<(), QuotaError> {
        if domain.is_empty() || path.is_empty() {
            return Err(QuotaError::Invalid("the domain and the level must not be empty".into()));
        }
        parse(amount, per).map_err(QuotaError::Invalid)?;
        self.client()
            .await?
            .execute(
                "INSERT INTO tollgate_budget_overrides (domain, path, amount, per) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (domain, path) DO UPDATE SET amount = EXCLUDED.amount, per = EXCLUDED.per, \
                 updated_at = now()",
                &[&domain, &path, &amount, &per],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    /// Deletes the override of the level `path` of `domain`; the number of rows deleted.
    pub async fn delete_budget(&self, domain: &str, path: &str) -> Result<u64, QuotaError> {
        self.client()
            .await?
            .execute(
                "DELETE FROM tollgate_budget_overrides WHERE domain = $1 AND path = $2",
                &[&domain, &path],
            )
            .await
            .map_err(db)
    }

    /// Every override (of `domain`, and of the level `path`, when given), ordered, as stored.
    pub async fn list_budgets(
        &self,
        domain: Option<&str>,
        path: Option<&str>,
    ) -> Result<Vec<BudgetRow>, QuotaError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT domain, path, amount, per FROM tollgate_budget_overrides \
                 WHERE ($1::text IS NULL OR domain = $1) AND ($2::text IS NULL OR path = $2) \
                 ORDER BY domain, path",
                &[&domain, &path],
            )
            .await
            .map_err(db)?;
        Ok(rows
            .iter()
            .map(|r| BudgetRow { domain: r.get(0), path: r.get(1), amount: r.get(2), per: r.get(3) })
            .collect())
    }
}

// A row's amount and period, checked as the domain file's are.
fn parse(amount: &str, per: Option<&str>) -> Result<BudgetOverride, String> {
    let amount = Money::parse(amount).map_err(|e| format!("amount: {e}"))?;
    let per = per
        .map(|p| {
            Per::parse(p)
                .ok_or_else(|| format!("per: unknown period '{p}' (minute, hour, day, week, month or year)"))
        })
        .transpose()?;
    Ok(BudgetOverride { amount, per })
}
