//! Each node's task list (`GET /nodes/{node}/tasks`), shared by every machine reconcile: while
//! this process waits for several tasks on one node, one list tells which of them ended and how,
//! instead of one status request per task. A list is fetched by one caller while the others
//! wait for it (single flight). An ended task stays ended, so a list answers for that whatever
//! its age; that a task still runs, a list answers only for a check that began before it was
//! asked for (a task checked when it is expected to end may have ended since an earlier list,
//! and would be noticed only at its next check). Clones, which wait long in their node's queue,
//! are listed apart from the node's other tasks. An endpoint whose lists fail, or leave
//! out a task of this process (a token that may not see its own tasks there), is not listed for
//! [`BLIND_FOR`]: its tasks are checked one by one. After a restart: nothing is kept, and the
//! first check that falls due lists again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::inventory::endpoint_key;
use crate::proxmox::{NodeTask, ProxmoxClient, TaskStatus, Upid};

/// Tasks asked for at most per list: a node's tasks since the oldest one this process waits for.
pub const LIST_LIMIT: usize = 500;

/// Task types that queue behind each other on their node: clones copy disks, and a node's
/// storage copies one disk's worth at a time however many clones share it.
pub fn queues_on_node(task_type: &str) -> bool {
    task_type == "qmclone"
}

/// The type a node's list of `task_type` is filtered to: a queueing task waits long, and a list
/// of every task since the oldest of them would be cut off, newest first, before reaching it.
fn listed_apart(task_type: &str) -> Option<&str> {
    queues_on_node(task_type).then_some(task_type)
}

/// Whether one list of their node shows both tasks.
pub fn listed_together(a: &Upid, b: &Upid) -> bool {
    listed_apart(&a.task_type) == listed_apart(&b.task_type)
}

/// How long an endpoint whose list failed or left out a task of this process is not listed.
pub const BLIND_FOR: Duration = Duration::from_secs(60);

/// Task lists by endpoint (base URL and token) and node.
#[derive(Clone, Default)]
pub struct NodeTaskLists {
    endpoints: Arc<Mutex<HashMap<String, Arc<Endpoint>>>>,
}

#[derive(Default)]
struct Endpoint {
    /// By node, and by type for the types listed apart.
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    /// Since when the endpoint's lists are not used.
    blind_since: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct Node {
    /// Held while fetching, so concurrent checks share one list.
    fetching: tokio::sync::Mutex<()>,
    latest: Mutex<Option<Arc<TaskList>>>,
}

/// One node's tasks as Proxmox listed them.
#[derive(Debug)]
pub struct TaskList {
    asked: Instant,
    since: u64,
    /// Fewer tasks than asked for: every task started since `since` is in it.
    complete: bool,
    tasks: HashMap<String, NodeTask>,
}

impl TaskList {
    fn new(asked: Instant, since: u64, listed: Vec<NodeTask>) -> Self {
        TaskList {
            asked,
            since,
            complete: listed.len() < LIST_LIMIT,
            tasks: listed
                .into_iter()
                .map(|task| (task.upid.clone(), task))
                .collect(),
        }
    }

    /// The task's state as listed.
    pub fn status_of(&self, upid: &Upid) -> Option<TaskStatus> {
        self.tasks.get(upid.as_str()).map(NodeTask::as_status)
    }

    /// Whether the list shows the task ended.
    pub fn ended(&self, upid: &Upid) -> bool {
        self.tasks.get(upid.as_str()).is_some_and(NodeTask::ended)
    }

    /// Whether it answers a check of `upid` (started at or after `since`) that began at
    /// `checking`: listed, and ended or listed after the check began.
    fn answers(&self, upid: &Upid, since: u64, checking: Instant) -> bool {
        self.since <= since
            && self.tasks.contains_key(upid.as_str())
            && (self.ended(upid) || self.asked >= checking)
    }
}

impl NodeTaskLists {
    /// The task's end as its node's latest list showed it, without asking Proxmox.
    pub fn listed_ended(&self, proxmox: &ProxmoxClient, upid: &Upid) -> Option<TaskStatus> {
        let node = self.endpoint(proxmox).list_of(upid);
        let latest = lock(&node.latest).clone()?;
        latest.ended(upid).then(|| latest.status_of(upid)).flatten()
    }

    /// The list of `upid`'s node with `upid` in it, showing it ended or asked for after this
    /// call began, of the tasks started at or after `since`. `None`: the
    /// endpoint's lists cannot answer for it (the list failed or left it out); check the task
    /// by itself.
    pub async fn list_with(
        &self,
        proxmox: &ProxmoxClient,
        upid: &Upid,
        since: u64,
    ) -> Option<Arc<TaskList>> {
        let endpoint = self.endpoint(proxmox);
        if endpoint.blind() {
            return None;
        }
        let checking = Instant::now();
        let node = endpoint.list_of(upid);
        let answering = |node: &Node| {
            lock(&node.latest)
                .clone()
                .filter(|list| list.answers(upid, since, checking))
        };
        if let Some(list) = answering(&node) {
            return Some(list);
        }
        let _fetching = node.fetching.lock().await;
        // Another check may have listed while this one waited, or found lists useless.
        if let Some(list) = answering(&node) {
            return Some(list);
        }
        if endpoint.blind() {
            return None;
        }
        let asked = Instant::now();
        let typefilter = listed_apart(&upid.task_type);
        let list = match proxmox
            .node_tasks(&upid.node, since, typefilter, LIST_LIMIT)
            .await
        {
            Ok(listed) => Arc::new(TaskList::new(asked, since, listed)),
            Err(error) => {
                tracing::info!(node = %upid.node, %error, blind_s = BLIND_FOR.as_secs(), "listing the node's tasks failed; checking tasks one by one for a while");
                endpoint.go_blind();
                return None;
            }
        };
        *lock(&node.latest) = Some(list.clone());
        if list.tasks.contains_key(upid.as_str()) {
            return Some(list);
        }
        if list.complete && upid.starttime >= since {
            tracing::info!(node = %upid.node, %upid, blind_s = BLIND_FOR.as_secs(), "the node's task list leaves out a task of this process (may the token see its own tasks there?); checking tasks one by one for a while");
            endpoint.go_blind();
        }
        None
    }

    fn endpoint(&self, proxmox: &ProxmoxClient) -> Arc<Endpoint> {
        lock(&self.endpoints)
            .entry(endpoint_key(proxmox))
            .or_default()
            .clone()
    }
}

impl Endpoint {
    /// The list that shows `upid`: its node's, of its type where that is listed apart.
    fn list_of(&self, upid: &Upid) -> Arc<Node> {
        let name = match listed_apart(&upid.task_type) {
            Some(task_type) => format!("{} {task_type}", upid.node),
            None => upid.node.clone(),
        };
        let mut nodes = lock(&self.nodes);
        if let Some(node) = nodes.get(&name) {
            return node.clone();
        }
        nodes.entry(name).or_default().clone()
    }

    fn blind(&self) -> bool {
        let mut since = lock(&self.blind_since);
        match *since {
            Some(at) if at.elapsed() < BLIND_FOR => true,
            Some(_) => {
                *since = None;
                false
            }
            None => false,
        }
    }

    fn go_blind(&self) {
        *lock(&self.blind_since) = Some(Instant::now());
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(upid: &Upid, ended: Option<&str>) -> NodeTask {
        NodeTask {
            upid: upid.as_str().to_owned(),
            starttime: Some(upid.starttime),
            endtime: ended.map(|_| upid.starttime + 1),
            status: ended.map(str::to_owned),
        }
    }

    fn upid(n: u32) -> Upid {
        Upid::new(
            "pve1",
            n,
            1,
            1_700_000_000 + u64::from(n),
            "qmstop",
            "101",
            "root@pam",
        )
    }

    #[test]
    fn a_list_tells_ended_tasks_and_their_exit_status_and_running_ones_as_running() {
        let (ok, failed, running, absent) = (upid(1), upid(2), upid(3), upid(4));
        let list = TaskList::new(
            Instant::now(),
            ok.starttime,
            vec![
                task(&ok, Some("OK")),
                task(&failed, Some("command 'qm stop' failed")),
                task(&running, None),
            ],
        );
        assert!(list.complete);
        assert!(list.ended(&ok) && list.status_of(&ok).is_some_and(|s| s.is_success()));
        assert!(list.ended(&failed));
        assert!(list.status_of(&failed).is_some_and(|s| !s.is_success()));
        assert!(!list.ended(&running));
        assert!(list.status_of(&running).is_some_and(|s| !s.is_finished()));
        assert_eq!(list.status_of(&absent), None);
    }

    #[test]
    fn a_list_answers_for_an_ended_task_at_any_age_and_for_a_running_one_only_if_asked_after() {
        let asked = Instant::now();
        let (ended, running, absent) = (upid(1), upid(2), upid(3));
        let list = TaskList::new(
            asked,
            ended.starttime,
            vec![task(&ended, Some("OK")), task(&running, None)],
        );
        let later = asked + Duration::from_millis(1);
        assert!(list.answers(&ended, ended.starttime, later + Duration::from_secs(60)));
        assert!(list.answers(&running, ended.starttime, asked));
        assert!(
            !list.answers(&running, ended.starttime, later),
            "it may have ended since"
        );
        assert!(!list.answers(&absent, ended.starttime, asked));
        assert!(
            !list.answers(&ended, ended.starttime - 1, asked),
            "a list of tasks started later may leave out one started before"
        );
        let full = TaskList::new(
            asked,
            100,
            (0..LIST_LIMIT as u32)
                .map(|n| task(&upid(n), None))
                .collect(),
        );
        assert!(
            !full.complete,
            "as many as asked for: more may have been left out"
        );
    }

    #[tokio::test]
    async fn a_clone_is_listed_though_its_node_ran_a_lists_worth_of_other_tasks_since() {
        use crate::proxmox::{ApiToken, ClientConfig, CloneParams, PowerAction};
        use capmox_sim::{SimOptions, Simulator, Topology};
        let sim = Simulator::start(
            Topology::example(),
            SimOptions {
                clone_duration: Duration::ZERO,
                task_duration: Duration::ZERO,
                ..SimOptions::default()
            },
        )
        .await
        .expect("simulator");
        let token = ApiToken::parse(&sim.token()).expect("token");
        let proxmox = ProxmoxClient::new(&ClientConfig::new(sim.url(), token)).expect("client");
        let clone = |newid| CloneParams {
            newid,
            ..CloneParams::default()
        };
        let first = proxmox.clone_vm("pve1", 9000, &clone(100)).await;
        let second = proxmox.clone_vm("pve1", 9000, &clone(101)).await;
        let (first, second) = (first.expect("clone"), second.expect("clone"));
        // More starts and stops of the second VM than a list holds, all newer than the clones.
        for n in 0..=LIST_LIMIT {
            let action = if n % 2 == 0 {
                PowerAction::Start
            } else {
                PowerAction::Stop
            };
            let task = proxmox.power("pve1", 101, action).await.expect("power");
            let upid = task.expect("a power task has a UPID");
            while !proxmox
                .task_status(&upid)
                .await
                .expect("status")
                .is_finished()
            {
                tokio::task::yield_now().await;
            }
        }
        let lists = NodeTaskLists::default();
        let list = lists
            .list_with(&proxmox, &first, first.starttime)
            .await
            .expect("the clone's list shows it");
        assert!(list.ended(&first) && list.ended(&second));
        assert!(lists.listed_ended(&proxmox, &second).is_some());
        let asked = sim
            .request_log()
            .into_iter()
            .filter(|request| request.path == "/nodes/pve1/tasks")
            .map(|request| request.params)
            .collect::<Vec<_>>();
        assert_eq!(asked.len(), 1);
        assert!(asked[0].contains(&"typefilter".to_owned()), "{asked:?}");
    }

    #[test]
    fn an_endpoint_that_went_blind_is_listed_again_after_a_while() {
        let endpoint = Endpoint::default();
        assert!(!endpoint.blind());
        endpoint.go_blind();
        assert!(endpoint.blind());
        *lock(&endpoint.blind_since) = Instant::now().checked_sub(BLIND_FOR);
        assert!(!endpoint.blind());
        assert!(lock(&endpoint.blind_since).is_none());
    }
}
