//! PostgreSQL: a throwaway server per test (initdb into a temporary directory).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::*;

/// A throwaway PostgreSQL server (initdb into a temp dir) on a loopback port.
pub struct Postgres {
    pub port: u16,
    proc: Option<Proc>,
    dir: tempfile::TempDir,
    bin: PathBuf,
    user: Option<(u32, u32)>,
}

impl Postgres {
    pub fn start() -> Postgres {
        Self::start_with(None)
    }

    /// A server that also accepts TLS, with `pki`'s server certificate.
    pub fn start_tls(pki: &TestPki) -> Postgres {
        Self::start_with(Some(pki))
    }

    fn start_with(pki: Option<&TestPki>) -> Postgres {
        let bin = postgres_bin_dir();
        let dir = scratch_dir("tollgate-pg");
        // PostgreSQL refuses to run as root: as root, run it as the `postgres` system user.
        let user = is_root().then(|| {
            let id = |flag: &str| -> u32 {
                let out = Command::new("id").args([flag, "postgres"]).output().expect("id postgres");
                String::from_utf8_lossy(&out.stdout)
                    .trim()
                    .parse()
                    .expect("a postgres system user (apt-get install postgresql)")
            };
            (id("-u"), id("-g"))
        });
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        if let Some((uid, gid)) = user {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
            std::os::unix::fs::chown(&data, Some(uid), Some(gid)).unwrap();
        }
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args(["-D", data.to_str().unwrap(), "-U", "tollgate", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .env("LC_ALL", "C")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        as_user(&mut initdb, user);
        assert!(initdb.status().expect("initdb").success(), "initdb failed");
        if let Some(pki) = pki {
            // The key must belong to the server's user and be private to it.
            use std::os::unix::fs::PermissionsExt;
            for file in ["server.pem", "server.key"] {
                let to = data.join(file);
                std::fs::copy(pki.path(file), &to).unwrap();
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
                if let Some((uid, gid)) = user {
                    std::os::unix::fs::chown(&to, Some(uid), Some(gid)).unwrap();
                }
            }
            let conf = "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n";
            let mut pgconf =
                std::fs::OpenOptions::new().append(true).open(data.join("postgresql.conf")).unwrap();
            pgconf.write_all(conf.as_bytes()).unwrap();
        }
        let mut pg = Postgres { port: free_port(), proc: None, dir, bin, user };
        pg.run();
        pg
    }

    // Starts the server on the existing data directory and waits until it accepts connections.
    fn run(&mut self) {
        let data = self.dir.path().join("data");
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.args(["-D", data.to_str().unwrap(), "-p", &self.port.to_string(), "-k", data.to_str().unwrap()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off", "-c", "logging_collector=off"])
            .env("LC_ALL", "C")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        as_user(&mut cmd, self.user);
        self.proc = Some(Proc::spawn("postgres", &mut cmd));
        let port = self.port;
        wait_until("postgres to accept connections", 500, Duration::from_millis(20), || {
            Command::new("pg_isready")
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "tollgate", "-d", "postgres"])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
    }

    pub fn url(&self) -> String {
        format!("postgres://tollgate@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs SQL through psql.
    pub fn sql(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .args([self.url().as_str(), "-v", "ON_ERROR_STOP=1", "-tAc", sql])
            .output()
            .expect("psql");
        assert!(out.status.success(), "psql: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Stops the server cleanly (fast shutdown); the data directory stays for `restart`.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal("INT");
            p.wait_exit(Duration::from_secs(30)).expect("postgres stops on SIGINT");
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn as_user(cmd: &mut Command, user: Option<(u32, u32)>) {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
}

// The server binaries: on PATH, else Debian's versioned directory (newest first).
fn postgres_bin_dir() -> PathBuf {
    if let Ok(out) = Command::new("sh").args(["-c", "command -v initdb"]).output() {
        let found = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !found.is_empty() {
            let path = std::fs::canonicalize(found).unwrap();
            return path.parent().unwrap().to_owned();
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed; run scripts/test, which installs it")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().expect("no initdb under /usr/lib/postgresql/*/bin")
}
