//! A directory laid out the way the kubelet mounts a ConfigMap, and its updates.

use std::path::{Path, PathBuf};

use super::*;

/// The mount: `rules.yaml -> ..data/rules.yaml`, `..data -> ..<timestamp>/`.
pub struct ConfigMap {
    dir: tempfile::TempDir,
    root: PathBuf,
    generation: usize,
}

impl ConfigMap {
    pub fn new(yaml: &str) -> ConfigMap {
        Self::nested("", yaml)
    }

    /// The mount at `under` inside a fresh directory ([`ConfigMap::top`]), as a volume mounted
    /// at `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config`.
    pub fn nested(under: &str, yaml: &str) -> ConfigMap {
        let dir = scratch_dir("tollgate-configmap");
        let root = dir.path().join(under);
        std::fs::create_dir_all(&root).unwrap();
        let mut cm = ConfigMap { dir, root, generation: 0 };
        cm.publish(yaml);
        std::os::unix::fs::symlink("..data/rules.yaml", cm.root.join("rules.yaml")).unwrap();
        cm
    }

    // What the kubelet does: write a new timestamped directory, point `..data_tmp` at it, rename
    // it over `..data` (atomic), remove the old directory.
    pub fn publish(&mut self, yaml: &str) {
        self.publish_files(&[("rules.yaml", yaml)]);
    }

    /// The same, with these files in the new directory (none: a target that lacks the file).
    pub fn publish_files(&mut self, files: &[(&str, &str)]) {
        let root = &self.root;
        self.generation += 1;
        let fresh = format!("..2026_12_02_{:02}", self.generation);
        std::fs::create_dir(root.join(&fresh)).unwrap();
        for (name, yaml) in files {
            std::fs::write(root.join(&fresh).join(name), yaml).unwrap();
        }
        std::os::unix::fs::symlink(&fresh, root.join("..data_tmp")).unwrap();
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
        if self.generation > 1 {
            std::fs::remove_dir_all(root.join(format!("..2026_12_02_{:02}", self.generation - 1))).unwrap();
        }
    }

    /// The mounted directory.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The directory the mount is inside.
    pub fn top(&self) -> &Path {
        self.dir.path()
    }
}
